"""A stand-in for the Hugging Face hub (lora/hub_source.HubSource): repos are snapshot directories on disk,
a private repo is read only with one of its tokens, and every question asked of it is counted."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from loraplex.lora.adapter import AdapterNotFound
from loraplex.lora.sources.hub_source import Snapshot

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


@dataclass
class FakeRepo:
    path: pathlib.Path
    revision: str
    tokens: frozenset[str]  # empty: public


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.asked: list[str] = []  # repo ids, one per question

    def publish(self, repo_id: str, path: pathlib.Path, *tokens: str, revision: str = COMMIT_A) -> None:
        """Put `path` up as `repo_id` (private when tokens are given: only they may read it)."""
        self.repos[repo_id] = FakeRepo(path, revision, frozenset(tokens))

    def resolve(self, repo_id: str, revision: str | None, token: str | None) -> Snapshot:
        self.asked.append(repo_id)
        repo = self.repos.get(repo_id)
        if repo is None or (repo.tokens and token not in repo.tokens):  # the hub answers both alike (401)
            raise AdapterNotFound(f"adapter {repo_id!r} not found on the fake hub, or not readable with this api_token")
        return Snapshot(repo.path, repo.revision)
