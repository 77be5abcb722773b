"""`raot-hf push DIR REPO_ID`: publish a merged model directory to the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path

import click

from raot_hf.errors import RaotError
from raot_hf.hub import push_to_hub

_TOKEN_HELP = (
    "Hub access token. Give `--token` with no value to type it at a hidden prompt (a value on the "
    "command line lands in your shell history). Without it, HF_TOKEN or the `hf auth login` cache is used."
)


@click.command("push")
@click.argument("folder", metavar="DIR", type=click.Path(path_type=Path))
@click.argument("repo_id", metavar="REPO_ID")
@click.option("--private", is_flag=True, help="Create the repository as private.")
@click.option("--revision", help="Branch to push to (created from main when missing).")
@click.option("--create-pr", is_flag=True, help="Open a pull request against main.")
@click.option("--commit-message", help="Commit title (default names raot-hf).")
@click.option(
    "--token",
    default=None,
    is_flag=False,
    flag_value="",
    prompt="Hugging Face token",
    prompt_required=False,
    hide_input=True,
    help=_TOKEN_HELP,
)
@click.option("--endpoint", envvar="HF_ENDPOINT", help="Hub URL (default: $HF_ENDPOINT, else https://huggingface.co).")
def push(folder: Path, repo_id: str, private: bool, revision, create_pr: bool, commit_message, token, endpoint) -> None:
    """Upload the merged model in DIR to the Hub repository REPO_ID and print the commit or PR URL."""
    try:
        url = push_to_hub(
            folder,
            repo_id,
            token=token or None,
            private=private,
            revision=revision,
            create_pr=create_pr,
            commit_message=commit_message,
            endpoint=endpoint or None,
        )
    except RaotError as exc:
        click.echo(f"Error: {exc}", err=True)
        raise SystemExit(2) from None
    click.echo(url)
