"""Pushing a merged folder to a Hub over real HTTP, with the real huggingface_hub client.

The Hub is `tests/hub_server.py`'s FakeHubServer on 127.0.0.1; nothing reaches the internet.
Two client upload paths are exercised: the default one (everything sent inline as "regular"
files, which is what the client does with hf_xet installed when the server asks for no LFS) and
the legacy LFS path (xet disabled, *.safetensors declared LFS, sent through the LFS batch API).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import huggingface_hub.constants as hf_constants
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save_file

from raot_hf.cli.push import push
from raot_hf.errors import RaotError
from raot_hf.hub import push_to_hub

try:  # tests/ on sys.path (rootdir-relative imports) or tests as a package
    from hub_server import DEFAULT_USER, FakeHubServer
except ImportError:  # pragma: no cover - depends on how pytest was configured
    from tests.hub_server import DEFAULT_USER, FakeHubServer

TOKEN = "hf_raotSecretToken_5f3c9a1e7b2d4c6a"
REPO_ID = "raot-org/merged-bert"


@pytest.fixture(autouse=True)
def isolated_hub_env(monkeypatch, tmp_path):
    """No real token, endpoint or telemetry leaks in; offline mode is lifted for 127.0.0.1 only.

    Every push in these tests names the local FakeHubServer as its endpoint (argument or
    HF_ENDPOINT), so lifting the suite-wide HF_HUB_OFFLINE here cannot reach the real Hub.
    """
    for name in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_ENDPOINT",
        "HF_OIDC_RESOURCE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.setattr(hf_constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf-home" / "stored_tokens"))


@pytest.fixture(params=["inline", "lfs"])
def upload_path(request, monkeypatch):
    """Which client upload path to exercise: inline regular files, or the LFS batch protocol."""
    if request.param == "lfs":
        monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    return request.param


@pytest.fixture
def hub_server(request):
    """A running FakeHubServer; `lfs` upload_path makes it declare *.safetensors as LFS."""
    lfs = "upload_path" in request.fixturenames and request.getfixturevalue("upload_path") == "lfs"
    server = FakeHubServer(lfs_patterns=("*.safetensors",) if lfs else ())
    with server:
        yield server


def write_merged_folder(folder: Path, seed: int = 0) -> Path:
    """A small stand-in for a merge output: config, safetensors weights, report, model card."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    config = {"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {
            "bert.embeddings.word_embeddings.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "bert.encoder.layer.0.output.dense.bias": rng.standard_normal(8).astype(np.float32),
        },
        str(folder / "model.safetensors"),
    )
    report = {"inputs": {"a": "org/a", "b": "org/b"}, "seed": seed, "gate": []}
    (folder / "raot_report.json").write_text(json.dumps(report))
    (folder / "README.md").write_text(
        "---\nbase_model:\n- org/a\n- org/b\ntags:\n- merge\n- raot\nlibrary_name: transformers\n---\n"
        f"# Merged model (seed {seed})\n"
    )
    return folder


def local_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def lfs_requests(server: FakeHubServer) -> list[str]:
    return [r.path for r in server.requests if ".git/info/lfs" in r.path or r.path.startswith("/lfs-")]


@pytest.mark.parametrize("private", [True, False])
def test_push_creates_repo_with_privacy_and_uploads_identical_bytes(hub_server, upload_path, tmp_path, private):
    folder = write_merged_folder(tmp_path / "merged")
    url = push_to_hub(folder, REPO_ID, token=TOKEN, private=private, endpoint=hub_server.endpoint)

    repo = hub_server.repos[REPO_ID]
    assert repo.private is private
    assert repo.repo_type == "model"
    assert hub_server.files(REPO_ID) == local_files(folder)
    weights = load_safetensors(hub_server.files(REPO_ID)["model.safetensors"])
    assert weights["bert.embeddings.word_embeddings.weight"].shape == (16, 8)

    (commit,) = hub_server.commits_for(REPO_ID)
    assert url == f"{hub_server.endpoint}/{REPO_ID}/commit/{commit.oid}"
    assert commit.ref == "main"
    assert "raot-hf" in commit.message
    assert hub_server.unhandled == []
    if upload_path == "lfs":
        sha = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
        assert sha in hub_server.lfs_objects
        assert any(path.endswith("/info/lfs/objects/batch") for path in lfs_requests(hub_server))
    else:
        assert lfs_requests(hub_server) == []


def test_repo_id_without_namespace_lands_in_the_users_namespace(hub_server, tmp_path):
    folder = write_merged_folder(tmp_path / "merged")
    url = push_to_hub(folder, "solo-model", token=TOKEN, endpoint=hub_server.endpoint)
    full_id = f"{DEFAULT_USER}/solo-model"
    assert url.startswith(f"{hub_server.endpoint}/{full_id}/commit/")
    assert hub_server.files(full_id) == local_files(folder)


def test_revision_creates_branch_and_leaves_main_untouched(hub_server, tmp_path):
    folder = write_merged_folder(tmp_path / "merged", seed=1)
    first = push_to_hub(folder, REPO_ID, token=TOKEN, revision="raot-v1", endpoint=hub_server.endpoint)
    assert hub_server.files(REPO_ID, "raot-v1") == local_files(folder)
    assert hub_server.files(REPO_ID, "main") == {}

    write_merged_folder(folder, seed=2)  # new weights, report and card; the branch exists now
    second = push_to_hub(
        folder, REPO_ID, token=TOKEN, revision="raot-v1", commit_message="second", endpoint=hub_server.endpoint
    )
    assert hub_server.files(REPO_ID, "raot-v1") == local_files(folder)
    assert hub_server.files(REPO_ID, "main") == {}
    commits = hub_server.commits_for(REPO_ID)
    assert [c.ref for c in commits] == ["raot-v1", "raot-v1"]
    assert commits[1].parent == commits[0].oid
    assert commits[1].message == "second"
    assert first.endswith(commits[0].oid) and second.endswith(commits[1].oid)
    branch_posts = [r for r in hub_server.requests if r.method == "POST" and "/branch/" in r.path]
    assert len(branch_posts) == 2  # asked both times; the second answer (409) was accepted
    assert hub_server.unhandled == []


def test_create_pr_opens_pull_request_and_leaves_main_untouched(hub_server, upload_path, tmp_path):
    folder = write_merged_folder(tmp_path / "merged", seed=3)
    push_to_hub(folder, REPO_ID, token=TOKEN, endpoint=hub_server.endpoint)
    main_before = hub_server.files(REPO_ID)

    write_merged_folder(folder, seed=4)
    url = push_to_hub(
        folder, REPO_ID, token=TOKEN, create_pr=True, commit_message="Proposed merge", endpoint=hub_server.endpoint
    )

    repo = hub_server.repos[REPO_ID]
    (pr,) = repo.pull_requests.values()
    assert url == f"{hub_server.endpoint}/{REPO_ID}/discussions/{pr.num}"
    assert hub_server.files(REPO_ID) == main_before
    assert hub_server.files(REPO_ID, pr.ref) == local_files(folder)
    assert hub_server.files(REPO_ID, pr.ref) != main_before
    pr_commits = [c for c in hub_server.commits_for(REPO_ID) if c.ref == pr.ref]
    assert [c.message for c in pr_commits] == ["Proposed merge"]
    assert hub_server.unhandled == []


def test_cli_sends_token_but_never_prints_logs_or_writes_it(hub_server, tmp_path, caplog, capfd, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_DEBUG", True)  # the client's most verbose request logging
    for name in (None, "raot_hf", "huggingface_hub", "httpx2", "httpx", "httpcore"):
        caplog.set_level(logging.DEBUG, logger=name)
    folder = write_merged_folder(tmp_path / "merged")
    before = local_files(folder)

    result = CliRunner().invoke(
        push,
        [str(folder), REPO_ID, "--private", "--token", TOKEN, "--endpoint", hub_server.endpoint],
        catch_exceptions=False,
    )

    assert result.exit_code == 0, result.output
    (commit,) = hub_server.commits_for(REPO_ID)
    assert result.stdout.strip() == f"{hub_server.endpoint}/{REPO_ID}/commit/{commit.oid}"
    assert hub_server.repos[REPO_ID].private is True
    api_requests = [r for r in hub_server.requests if r.path.startswith("/api/")]
    assert api_requests and all(r.authorization == f"Bearer {TOKEN}" for r in api_requests)

    assert any(r.name.startswith("raot_hf.hub") for r in caplog.records)
    captured = capfd.readouterr()
    for text in (result.stdout, result.stderr, caplog.text, captured.out, captured.err):
        assert TOKEN not in text
    assert all(TOKEN not in r.getMessage() for r in caplog.records)
    assert local_files(folder) == before  # nothing written into the folder
    assert all(TOKEN.encode() not in data for data in hub_server.files(REPO_ID).values())


def test_cli_token_flag_without_value_prompts_with_hidden_input(hub_server, tmp_path):
    folder = write_merged_folder(tmp_path / "merged")
    result = CliRunner().invoke(
        push, [str(folder), REPO_ID, "--endpoint", hub_server.endpoint, "--token"], input=f"{TOKEN}\n"
    )
    assert result.exit_code == 0, result.output
    assert TOKEN not in result.output
    assert f"Bearer {TOKEN}" in hub_server.authorization_headers()


def test_cli_reads_hf_endpoint_and_hf_token_from_environment(hub_server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub_server.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    folder = write_merged_folder(tmp_path / "merged")
    result = CliRunner().invoke(push, [str(folder), REPO_ID, "--revision", "candidate"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().startswith(f"{hub_server.endpoint}/{REPO_ID}/commit/")
    assert hub_server.files(REPO_ID, "candidate") == local_files(folder)
    assert set(hub_server.authorization_headers()) == {f"Bearer {TOKEN}"}
    assert TOKEN not in result.output


def test_cli_without_any_token_sends_no_authorization(hub_server, tmp_path):
    folder = write_merged_folder(tmp_path / "merged")
    result = CliRunner().invoke(push, [str(folder), REPO_ID, "--endpoint", hub_server.endpoint])
    assert result.exit_code == 0, result.output
    assert set(hub_server.authorization_headers()) == {None}


def _break_missing_dir(folder: Path) -> Path:
    return folder / "does-not-exist"


def _break_file_not_dir(folder: Path) -> Path:
    return folder / "config.json"


def _remover(name: str):
    def remove(folder: Path) -> Path:
        (folder / name).unlink()
        return folder

    return remove


@pytest.mark.parametrize(
    ("breaker", "expected"),
    [
        (_break_missing_dir, "does not exist"),
        (_break_file_not_dir, "not a directory"),
        (_remover("config.json"), "config.json"),
        (_remover("raot_report.json"), "raot_report.json"),
        (_remover("model.safetensors"), "safetensors"),
    ],
)
def test_cli_bad_folder_exits_2_with_one_line_before_any_request(hub_server, tmp_path, breaker, expected):
    target = breaker(write_merged_folder(tmp_path / "merged"))
    result = CliRunner().invoke(push, [str(target), REPO_ID, "--token", TOKEN, "--endpoint", hub_server.endpoint])
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and expected in lines[0]
    assert "Traceback" not in result.output
    assert hub_server.requests == []


@pytest.mark.parametrize(
    ("extra_args", "repo_id", "expected"),
    [
        (["--revision", "dev", "--create-pr"], REPO_ID, "--create-pr"),
        ([], "too/many/parts", "invalid repo id"),
    ],
)
def test_cli_conflicting_arguments_exit_2_before_any_request(hub_server, tmp_path, extra_args, repo_id, expected):
    folder = write_merged_folder(tmp_path / "merged")
    args = [str(folder), repo_id, "--endpoint", hub_server.endpoint, *extra_args]
    result = CliRunner().invoke(push, args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and expected in lines[0]
    assert hub_server.requests == []


def test_rejected_token_is_a_one_line_error_that_does_not_echo_the_token(tmp_path):
    folder = write_merged_folder(tmp_path / "merged")
    wrong = "hf_wrongTokenValue_0123456789abcdef"
    with FakeHubServer(required_token=TOKEN) as server:
        result = CliRunner().invoke(push, [str(folder), REPO_ID, "--token", wrong, "--endpoint", server.endpoint])
        with pytest.raises(RaotError, match="HTTP 401"):
            push_to_hub(folder, REPO_ID, endpoint=server.endpoint)  # no token at all
        assert server.repos == {}
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "HTTP 401" in lines[0] and "--token" in lines[0]
    assert wrong not in result.output


def test_offline_mode_is_a_one_line_error_before_any_request(hub_server, tmp_path, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    folder = write_merged_folder(tmp_path / "merged")
    result = CliRunner().invoke(push, [str(folder), REPO_ID, "--endpoint", hub_server.endpoint])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "HF_HUB_OFFLINE" in lines[0]
    assert hub_server.requests == []


def test_push_to_hub_error_is_a_value_error_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match="raot-hf merge"):
        push_to_hub(tmp_path / "nowhere", REPO_ID, endpoint="http://127.0.0.1:9")
