"""Publish a merged model directory to the Hugging Face Hub: checked locally first (no network
traffic for a wrong path), then uploaded in one ``upload_folder`` call. The access token is only
ever handed to :class:`huggingface_hub.HfApi`: never logged, printed or written to a file."""

from __future__ import annotations

import logging
from pathlib import Path

from huggingface_hub import HfApi, constants
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from raot_hf.errors import RaotError
from raot_hf.version import __version__

logger = logging.getLogger("raot_hf.hub")

#: Files a merged model directory must hold at its top level (besides the weights).
REQUIRED_FILES = ("config.json", "raot_report.json")

DEFAULT_BRANCH = "main"


def validate_merged_folder(folder: str | Path) -> Path:
    """``folder`` as a ``Path`` if it is a merged model directory (``config.json``, a
    ``*.safetensors`` file and ``raot_report.json``); else a one-line :class:`RaotError`."""
    path = Path(folder).expanduser()
    if not path.exists():
        raise RaotError(f"folder {str(path)!r} does not exist; pass the output directory of `raot-hf merge`")
    if not path.is_dir():
        raise RaotError(f"{str(path)!r} is not a directory; pass the output directory of `raot-hf merge`")
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise RaotError(
            f"folder {str(path)!r} has no {', '.join(missing)}; it is not a raot-hf merge output "
            "(re-run `raot-hf merge` into it, or pass the right directory)"
        )
    if not any(candidate.is_file() for candidate in path.glob("*.safetensors")):
        raise RaotError(
            f"folder {str(path)!r} has no *.safetensors weights; re-run `raot-hf merge` into it "
            "(it writes safetensors), or pass the right directory"
        )
    return path


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    endpoint: str | None = None,
) -> str:
    """Upload a merged model directory to ``repo_id`` (``"namespace/name"``) on the Hub; returns
    the URL of the commit, or of the pull request with ``create_pr``.

    ``token``: None lets ``huggingface_hub`` find one (``HF_TOKEN``, then the login cache); never
    logged. ``private`` is ignored for an existing repository; ``revision``: branch, created from
    the default branch when missing; ``endpoint``: None means ``HF_ENDPOINT`` or huggingface.co.
    Raises :class:`RaotError` for a non-merge folder, conflicting arguments, offline mode or a
    refused token.
    """
    path = validate_merged_folder(folder)
    try:  # argument combinations the Hub client would refuse, before any HTTP request
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise RaotError(
            f"invalid repo id {repo_id!r}; use 'namespace/name' with letters, digits, '-', '_' or '.'"
        ) from exc
    if revision is not None and not revision.strip():
        raise RaotError("empty --revision; pass a branch name or leave it out to push to main")
    if create_pr and revision not in (None, DEFAULT_BRANCH):
        raise RaotError(
            f"--create-pr always opens a pull request against {DEFAULT_BRANCH!r}; "
            f"drop --revision {revision!r} or drop --create-pr"
        )
    if constants.is_offline_mode():
        raise RaotError("Hugging Face offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE); unset it to push")
    message = commit_message or f"Upload RaOT-merged model with raot-hf {__version__}"
    api = HfApi(endpoint=endpoint, token=token)
    files = [f for f in path.rglob("*") if f.is_file() and ".git" not in f.parts and ".cache" not in f.parts]
    n_bytes = sum(f.stat().st_size for f in files)
    try:
        logger.info("Creating (or reusing) model repo %s on %s (private=%s)", repo_id, api.endpoint, private)
        full_repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id or repo_id
        # a pull-request ref (refs/...) exists already and cannot be created as a branch
        if revision not in (None, DEFAULT_BRANCH) and not revision.startswith("refs/"):
            logger.info("Ensuring branch %r exists in %s", revision, full_repo_id)
            api.create_branch(full_repo_id, branch=revision, exist_ok=True, repo_type="model")
        target = "a pull request against main" if create_pr else repr(revision or DEFAULT_BRANCH)
        logger.info(
            "Uploading %d file(s) (%.1f MB) from %s to %s, %s", len(files), n_bytes / 1e6, path, full_repo_id, target
        )
        commit = api.upload_folder(
            repo_id=full_repo_id, folder_path=path, repo_type="model", revision=revision, create_pr=create_pr,
            commit_message=message,
        )  # fmt: skip
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):  # one line, never quoting the token
            raise RaotError(
                f"the Hub refused write access to {repo_id!r} (HTTP {status}); use a token with write "
                "permission: pass --token, set HF_TOKEN, or run `hf auth login`"
            ) from None
        raise
    url = commit.pr_url if create_pr and commit.pr_url else commit.commit_url
    logger.info("Pushed %s to %s", path, url)
    return url
