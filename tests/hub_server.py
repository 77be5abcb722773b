"""A local stand-in for the Hugging Face Hub's HTTP API, for tests of pushing.

It speaks enough of the Hub protocol for the real ``huggingface_hub`` client to run
``create_repo``, ``create_branch``, ``create_pull_request`` and ``upload_folder`` against it, over
real HTTP on 127.0.0.1, and it records everything that arrives (requests with their
``Authorization`` headers, repositories, commits, pull requests, file bytes).

Endpoints (``{type}`` is ``models``/``datasets``/``spaces``, ``{repo}`` is ``namespace/name``,
``{rev}`` a URL-quoted branch or ``refs/pr/N``):

* ``POST /api/repos/create``                         create a repo (409 with its URL if it exists)
* ``GET  /api/{type}/{repo}``, ``.../revision/{rev}`` repo info (sha, private, siblings)
* ``POST /api/{type}/{repo}/branch/{branch}``         create a branch (409 if it exists)
* ``POST /api/{type}/{repo}/preupload/{rev}``         upload modes: "regular", or "lfs" for paths
  matching ``lfs_patterns`` (empty by default, so the client never needs xet or LFS)
* ``POST /api/{type}/{repo}/commit/{rev}``            NDJSON commit; ``?create_pr=1`` opens a PR
* ``POST /api/{type}/{repo}/discussions``             open a (pull request) discussion
* ``GET  /api/{type}/{repo}/discussions/{num}``       discussion details
* ``POST /api/validate-yaml``                         model card metadata check (always valid)
* ``POST /[{type}/]{repo}.git/info/lfs/objects/batch`` LFS batch API, "basic" transfer only; its
  actions point at the two endpoints below
* ``PUT  /lfs-upload/{oid}``                          LFS object upload target (no auth, like a
  presigned URL; checks the sha256)
* ``POST /lfs-verify``                                LFS verify (object stored, size matches)

Note: with ``hf_xet`` installed the client sends every "lfs" file through xet, which this server
does not speak; tests that want the LFS path set ``huggingface_hub.constants.HF_HUB_DISABLE_XET``.

Anything else answers 404 and is listed in :attr:`FakeHubServer.unhandled`.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

DEFAULT_USER = "raot-tester"
_TIMESTAMP = "2024-01-01T00:00:00.000Z"
_REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}


@dataclass
class RecordedRequest:
    """One HTTP request as it reached the server."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body_size: int

    @property
    def authorization(self) -> str | None:
        """The ``Authorization`` header, or None when the client sent none."""
        return self.headers.get("authorization")


@dataclass
class HubCommit:
    """A commit the server accepted: its ref, message and the full tree after it."""

    oid: str
    repo_id: str
    ref: str
    parent: str | None
    message: str
    description: str
    files: dict[str, bytes]
    pull_request: int | None = None


@dataclass
class HubPullRequest:
    """A pull request: its number, title, git ref and target branch."""

    num: int
    repo_id: str
    title: str
    description: str
    base: str

    @property
    def ref(self) -> str:
        """Git reference commits are pushed to."""
        return f"refs/pr/{self.num}"


@dataclass
class HubRepo:
    """A repository: privacy, type, and refs (branch or PR ref -> head commit oid)."""

    repo_id: str
    repo_type: str
    private: bool
    refs: dict[str, str] = field(default_factory=dict)
    pull_requests: dict[int, HubPullRequest] = field(default_factory=dict)


class _HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.extra = extra or {}


def git_blob_sha1(content: bytes) -> str:
    """The git object id of a blob, as the Hub reports it for regular files."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class FakeHubServer:
    """Threaded HTTP server on 127.0.0.1 imitating the Hub's upload API; see the module docstring.

    Args:
        required_token: when set, API and LFS requests must carry ``Bearer <required_token>``
            (else 401), so tests can prove the token was sent.
        lfs_patterns: glob patterns of paths that preupload declares "lfs"; the rest is "regular".
    """

    def __init__(self, *, required_token: str | None = None, lfs_patterns: tuple[str, ...] = ()):
        self.required_token = required_token
        self.lfs_patterns = tuple(lfs_patterns)
        self.requests: list[RecordedRequest] = []
        self.unhandled: list[str] = []
        self.repos: dict[str, HubRepo] = {}
        self.commits: dict[str, HubCommit] = {}
        self.commit_log: list[HubCommit] = []
        self.lfs_objects: dict[str, bytes] = {}
        self.lock = threading.RLock()
        self._counter = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.endpoint = ""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FakeHubServer:
        """Bind a free port on 127.0.0.1 and serve in a daemon thread."""
        handler = type("BoundHubHandler", (_HubHandler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        host, port = self._httpd.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-hub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeHubServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # ------------------------------------------------------------------ queries for tests

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The tree (path -> bytes) at the head of ``revision`` (branch or ``refs/pr/N``)."""
        with self.lock:
            repo = self.repos[repo_id]
            return dict(self.commits[repo.refs[revision]].files)

    def commits_for(self, repo_id: str) -> list[HubCommit]:
        """Commits pushed to ``repo_id`` (not counting the initial one), oldest first."""
        with self.lock:
            return [c for c in self.commit_log if c.repo_id == repo_id and c.parent is not None]

    def authorization_headers(self) -> list[str | None]:
        """The ``Authorization`` header of every request received, in order."""
        with self.lock:
            return [r.authorization for r in self.requests]

    # ------------------------------------------------------------------ state changes

    def _new_oid(self, salt: str) -> str:
        self._counter += 1
        return hashlib.sha1(f"{self._counter}:{salt}".encode()).hexdigest()

    def _repo(self, repo_type: str, repo_id: str) -> HubRepo:
        repo = self.repos.get(repo_id)
        if repo is None or repo.repo_type != repo_type:
            raise _HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def _resolve(self, repo: HubRepo, revision: str) -> str:
        if revision in repo.refs:
            return repo.refs[revision]
        if revision in self.commits and self.commits[revision].repo_id == repo.repo_id:
            return revision
        raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _repo_url(self, repo: HubRepo) -> str:
        return f"{self.endpoint}/{_URL_PREFIX[repo.repo_type]}{repo.repo_id}"

    def create_repo(self, body: dict) -> dict:
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise _HubError(400, "Missing repo name")
        repo_id = f"{body.get('organization') or DEFAULT_USER}/{name}"
        repo_type = body.get("type") or "model"
        private = body.get("visibility") == "private" or body.get("private") is True
        if repo_id in self.repos:
            url = self._repo_url(self.repos[repo_id])
            raise _HubError(409, "You already created this model repo", extra={"url": url})
        repo = HubRepo(repo_id=repo_id, repo_type=repo_type, private=private)
        initial = HubCommit(self._new_oid(repo_id), repo_id, "main", None, "initial commit", "", {})
        self.commits[initial.oid] = initial
        self.commit_log.append(initial)
        repo.refs["main"] = initial.oid
        self.repos[repo_id] = repo
        return {"url": self._repo_url(repo), "name": repo_id, "id": initial.oid}

    def create_branch(self, repo: HubRepo, branch: str, body: dict) -> dict:
        if branch.startswith("refs/") or not branch:
            raise _HubError(400, f"Invalid reference for a branch: {branch}")
        if branch in repo.refs:
            raise _HubError(409, "Reference already exists")
        repo.refs[branch] = self._resolve(repo, body.get("startingPoint") or "main")
        return {}

    def open_pull_request(self, repo: HubRepo, title: str, description: str, base: str) -> HubPullRequest:
        head = self._resolve(repo, base)
        num = max([0, *repo.pull_requests]) + 1
        pr = HubPullRequest(num=num, repo_id=repo.repo_id, title=title, description=description, base=base)
        repo.pull_requests[num] = pr
        repo.refs[pr.ref] = head
        return pr

    def pr_url(self, repo: HubRepo, num: int) -> str:
        return f"{self._repo_url(repo)}/discussions/{num}"

    def discussion_details(self, repo: HubRepo, num: int) -> dict:
        pr = repo.pull_requests.get(num)
        if pr is None:
            raise _HubError(404, f"Discussion {num} not found", "EntryNotFound")
        return {
            "num": pr.num,
            "title": pr.title,
            "status": "draft",
            "isPullRequest": True,
            "createdAt": _TIMESTAMP,
            "author": {"name": DEFAULT_USER},
            "repo": {"name": repo.repo_id, "type": repo.repo_type},
            "events": [],
            "changes": {"base": f"refs/heads/{pr.base}"},
            "filesWithConflicts": [],
            "diff": "",
        }

    def upload_modes(self, repo: HubRepo, revision: str, body: dict) -> dict:
        head = self.commits[self._resolve(repo, revision)]
        answers = []
        for item in body.get("files", []):
            path = item["path"]
            is_lfs = any(fnmatch.fnmatch(path, pattern) for pattern in self.lfs_patterns)
            existing = head.files.get(path)
            oid = None
            if existing is not None:
                oid = hashlib.sha256(existing).hexdigest() if is_lfs else git_blob_sha1(existing)
            answers.append(
                {"path": path, "uploadMode": "lfs" if is_lfs else "regular", "shouldIgnore": False, "oid": oid}
            )
        return {"files": answers, "commitOid": head.oid}

    def commit(self, repo: HubRepo, revision: str, lines: list[dict], create_pr: bool) -> dict:
        if not lines or lines[0].get("key") != "header":
            raise _HubError(400, "First line of a commit must be its header")
        header = lines[0]["value"]
        head_oid = self._resolve(repo, revision)
        parent_commit = header.get("parentCommit")
        if parent_commit and not create_pr and parent_commit != head_oid:
            raise _HubError(412, "A commit has happened since. Please refresh and try again.")
        pr = None
        ref = revision
        if create_pr:
            pr = self.open_pull_request(repo, header.get("summary", ""), header.get("description", ""), revision)
            ref = pr.ref
        elif revision not in repo.refs:
            raise _HubError(400, f"Cannot commit to {revision}: not a branch")
        files = dict(self.commits[head_oid].files)
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            if key == "file":
                if value.get("encoding") != "base64":
                    raise _HubError(400, f"Unsupported encoding for {value.get('path')}")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                content = self.lfs_objects.get(value.get("oid"))
                if content is None:
                    raise _HubError(422, f"LFS object {value.get('oid')} of {value.get('path')} was never uploaded")
                files[value["path"]] = content
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    raise _HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {p: b for p, b in files.items() if not p.startswith(prefix)}
            else:
                raise _HubError(400, f"Unknown commit operation {key!r}")
        commit = HubCommit(
            oid=self._new_oid(header.get("summary", "")),
            repo_id=repo.repo_id,
            ref=ref,
            parent=head_oid,
            message=header.get("summary", ""),
            description=header.get("description", ""),
            files=files,
            pull_request=pr.num if pr else None,
        )
        self.commits[commit.oid] = commit
        self.commit_log.append(commit)
        repo.refs[ref] = commit.oid
        return {
            "success": True,
            "commitOid": commit.oid,
            "commitUrl": f"{self._repo_url(repo)}/commit/{commit.oid}",
            "hookOutput": "",
            "pullRequestUrl": self.pr_url(repo, pr.num) if pr else None,
        }

    def lfs_batch(self, body: dict) -> dict:
        if body.get("operation") != "upload":
            raise _HubError(400, "Only the upload operation is supported")
        if "basic" not in body.get("transfers", ["basic"]):
            raise _HubError(422, "This server only offers the 'basic' LFS transfer")
        objects = []
        for item in body.get("objects", []):
            oid, size = item["oid"], item["size"]
            answer: dict = {"oid": oid, "size": size, "authenticated": True}
            if oid not in self.lfs_objects:
                answer["actions"] = {
                    "upload": {"href": f"{self.endpoint}/lfs-upload/{oid}"},
                    "verify": {"href": f"{self.endpoint}/lfs-verify", "header": {}},
                }
            objects.append(answer)
        return {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}

    def repo_info(self, repo: HubRepo, revision: str) -> dict:
        head = self.commits[self._resolve(repo, revision)]
        return {
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "sha": head.oid,
            "private": repo.private,
            "lastModified": _TIMESTAMP,
            "tags": [],
            "siblings": [{"rfilename": path} for path in sorted(head.files)],
        }


class _HubHandler(BaseHTTPRequestHandler):
    """Routes requests to the bound :class:`FakeHubServer` (class attribute ``hub``)."""

    hub: FakeHubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - silence the default stderr access log
        return

    # --- plumbing

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size_line = self.rfile.readline().strip().split(b";")[0]
                size = int(size_line, 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, payload: dict | None = None, headers: dict | None = None) -> None:
        data = json.dumps(payload if payload is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        hub = self.hub
        split = urlsplit(self.path)
        segments = [unquote(s) for s in split.path.split("/") if s]
        body = self._read_body()
        with hub.lock:
            hub.requests.append(
                RecordedRequest(
                    method=method,
                    path=split.path,
                    query=parse_qs(split.query),
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body_size=len(body),
                )
            )
        try:
            if not (segments and segments[0] == "lfs-upload"):
                self._check_token()
            with hub.lock:
                payload = self._route(method, segments, parse_qs(split.query), body)
        except _HubError as err:
            headers = {"X-Error-Message": err.message}
            if err.code:
                headers["X-Error-Code"] = err.code
            self._send(err.status, {"error": err.message, **err.extra}, headers)
            return
        self._send(200, payload)

    def _check_token(self) -> None:
        expected = self.hub.required_token
        if expected is None:
            return
        if self.headers.get("Authorization") != f"Bearer {expected}":
            raise _HubError(401, "Invalid credentials in Authorization header")

    def _route(self, method: str, seg: list[str], query: dict, body: bytes) -> dict:
        hub = self.hub
        if method == "PUT" and len(seg) == 2 and seg[0] == "lfs-upload":
            if hashlib.sha256(body).hexdigest() != seg[1]:
                raise _HubError(400, "Uploaded content does not match its sha256 oid")
            hub.lfs_objects[seg[1]] = body
            return {}
        if method == "POST" and seg == ["lfs-verify"]:
            item = json.loads(body)
            stored = hub.lfs_objects.get(item.get("oid"))
            if stored is None or len(stored) != item.get("size"):
                raise _HubError(404, "LFS object missing or of the wrong size")
            return {}
        if method == "POST" and seg == ["api", "repos", "create"]:
            return hub.create_repo(json.loads(body or b"{}"))
        if method == "POST" and seg == ["api", "validate-yaml"]:
            return {"errors": [], "warnings": []}
        if len(seg) >= 4 and seg[0] == "api" and seg[1] in _REPO_TYPES:
            return self._route_repo_api(method, _REPO_TYPES[seg[1]], f"{seg[2]}/{seg[3]}", seg[4:], query, body)
        lfs = self._match_lfs(seg)
        if method == "POST" and lfs is not None:
            repo_type, repo_id, action = lfs
            hub._repo(repo_type, repo_id)
            if action == "batch":
                return hub.lfs_batch(json.loads(body))
        hub.unhandled.append(f"{method} {'/'.join(seg)}")
        raise _HubError(404, f"Fake hub does not implement {method} /{'/'.join(seg)}")

    @staticmethod
    def _match_lfs(seg: list[str]) -> tuple[str, str, str] | None:
        """Parse ``[type/]ns/name.git/info/lfs/objects/<action>``."""
        repo_type = "model"
        if seg and seg[0] in _REPO_TYPES and len(seg) == 7:
            repo_type, seg = _REPO_TYPES[seg[0]], seg[1:]
        if len(seg) == 6 and seg[1].endswith(".git") and seg[2:5] == ["info", "lfs", "objects"]:
            return repo_type, f"{seg[0]}/{seg[1][: -len('.git')]}", seg[5]
        return None

    def _route_repo_api(
        self, method: str, repo_type: str, repo_id: str, rest: list[str], query: dict, body: bytes
    ) -> dict:
        hub = self.hub
        repo = hub._repo(repo_type, repo_id)
        create_pr = query.get("create_pr", ["0"])[0] in ("1", "true")
        if method == "GET" and not rest:
            return hub.repo_info(repo, "main")
        if method == "GET" and len(rest) == 2 and rest[0] == "revision":
            return hub.repo_info(repo, rest[1])
        if method == "POST" and len(rest) == 2 and rest[0] == "branch":
            return hub.create_branch(repo, rest[1], json.loads(body or b"{}"))
        if method == "POST" and len(rest) == 2 and rest[0] == "preupload":
            return hub.upload_modes(repo, rest[1], json.loads(body))
        if method == "POST" and len(rest) == 2 and rest[0] == "commit":
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            return hub.commit(repo, rest[1], lines, create_pr)
        if method == "POST" and rest == ["discussions"]:
            data = json.loads(body)
            if not data.get("pullRequest"):
                raise _HubError(400, "The fake hub only opens pull requests")
            pr = hub.open_pull_request(repo, data.get("title", ""), data.get("description", ""), "main")
            return {"num": pr.num, "url": hub.pr_url(repo, pr.num), "pullRequest": {"ref": pr.ref}}
        if method == "GET" and len(rest) == 2 and rest[0] == "discussions" and rest[1].isdigit():
            return hub.discussion_details(repo, int(rest[1]))
        hub.unhandled.append(f"{method} api/{repo_type}s/{repo_id}/{'/'.join(rest)}")
        raise _HubError(404, f"Fake hub does not implement {method} {'/'.join(rest)} on {repo_id}")

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._handle("PUT")


__all__ = [
    "DEFAULT_USER",
    "FakeHubServer",
    "HubCommit",
    "HubPullRequest",
    "HubRepo",
    "RecordedRequest",
    "git_blob_sha1",
]
