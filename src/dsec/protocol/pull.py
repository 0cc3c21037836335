"""Pulling a registry image onto the node (``POST /v1/images/pull``): the request, and the events of its
answer, a stream of progress lines ending with the image or an error."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .names import PULL_POLICY_DOC, ImageName, PullPolicy
from .sandbox import ErrorBody, ImageInfo

__all__ = ["PullEvent", "PullPolicy", "PullProgress", "PullRequest", "PushRequest", "PushResult"]


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reference: ImageName = Field(description="A registry reference: registry.example:5000/org/task:1, python:3.11.")
    policy: PullPolicy = Field(default="if-not-present", description=PULL_POLICY_DOC)


class PullProgress(BaseModel):
    phase: str = Field(description="What the pull does now: resolving, fetching, converting, publishing, done.")
    layers: int = Field(default=0, ge=0, description="Layers the image has.")
    layers_done: int = Field(default=0, ge=0, description="Layers ready (fetched and converted, or reused).")
    layers_reused: int = Field(default=0, ge=0, description="Layers the repository had already: not fetched.")
    bytes_total: int = Field(default=0, ge=0, description="Compressed bytes of the layers to fetch.")
    bytes_fetched: int = Field(default=0, ge=0, description="Compressed bytes fetched so far.")


class PullEvent(BaseModel):
    """One line of a pull's answer: progress while it runs, then the image or the error."""

    type: Literal["progress", "result", "error"]
    progress: PullProgress | None = None
    image: ImageInfo | None = None
    error: ErrorBody | None = None


class PushRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: ImageName = Field(description="The dsec image to push (a snapshot, a build, a pulled image).")
    reference: ImageName = Field(
        description="Where: registry.example:5000/org/env:1 (a tag; without one, latest). Docker Hub for a short name."
    )


class PushResult(BaseModel):
    reference: str = Field(description="The canonical reference pushed, with the manifest's digest.")
    digest: str = Field(description="sha256 of the image manifest the registry now holds.")
    layers: int = Field(ge=0)
    layers_uploaded: int = Field(ge=0, description="Layers the repository did not have (the rest were there).")
    bytes_uploaded: int = Field(ge=0, description="Compressed bytes sent, the config included.")
    seconds: float = Field(ge=0)
