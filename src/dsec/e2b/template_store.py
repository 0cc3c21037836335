"""What E2B's templates are on a node: a name owned by a tenant, its builds (each one immutable dsec
image, ``e2b/<template id>:<build id>``) and its tags (a tag names one build). Kept in one JSON file in
the state directory, written whole (a temporary file renamed over it) after every change.

Names are one namespace for the node, as image names are: a name another tenant holds is refused as
taken, without saying whose. A tenant sees and uses its own templates and the operator's; it changes
only its own (the operator, every one).
"""

from __future__ import annotations

import os
import re
import secrets
import string
import uuid
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from ..errors import Forbidden, ImageExists, InvalidRequest, NotFound
from ..tenancy import Caller
from .template_models import DEFAULT_TAG, NAME, TAG, Status

IMAGE_PREFIX = "e2b/"
ID_ALPHABET = string.ascii_lowercase + string.digits
MAX_TEMPLATES = 10_000
MAX_BUILDS = 32  # per template: past it the oldest builds no tag names are forgotten (and their images removed)


class TemplateTaken(ImageExists):
    """A template name held by another tenant: taken, as an image name another tenant holds is."""

    code = "template_exists"


class Build(BaseModel):
    id: str
    status: Status = "waiting"
    created_at: datetime
    finished_at: datetime | None = None
    reason: str | None = None
    step: str | None = None  # E2B's name of the step that failed
    tags: list[str] = Field(default_factory=list)  # asked for by the request, assigned when it is ready


class Tagged(BaseModel):
    build: str
    at: datetime


class Template(BaseModel):
    id: str
    name: str
    owner: str | None  # a tenant; None: the operator's
    created_at: datetime
    builds: dict[str, Build] = Field(default_factory=dict)
    tags: dict[str, Tagged] = Field(default_factory=dict)

    def image(self, build_id: str) -> str:
        return f"{IMAGE_PREFIX}{self.id}:{build_id.replace('-', '')}"


class _File(BaseModel):
    templates: dict[str, Template] = Field(default_factory=dict)


def split_name(ref: str) -> tuple[str, str | None]:
    """``name`` or ``name:tag`` (E2B's way to name a build)."""
    name, colon, tag = ref.partition(":")
    return name, (tag if colon else None)


def check_name(name: str) -> str:
    if not re.fullmatch(NAME, name):
        raise InvalidRequest(
            f"template name {name[:80]!r}: 1-63 characters of a-z 0-9 . _ -, starting with a letter or digit"
        )
    return name


def check_tag(tag: str) -> str:
    if not re.fullmatch(TAG, tag):
        raise InvalidRequest(f"tag {tag[:80]!r}: 1-128 characters of A-Z a-z 0-9 _ . -, not starting with . or -")
    return tag


def now() -> datetime:
    return datetime.now(UTC)


class TemplateStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = _File()
        try:
            self.data = _File.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            pass
        except (ValidationError, OSError) as e:
            raise InvalidRequest(f"E2B templates file {path} is unreadable: {e}") from None
        for template in self.data.templates.values():
            for build in template.builds.values():
                if build.status in ("waiting", "building"):  # a build the daemon did not see end
                    build.status, build.reason = "error", "the daemon stopped during the build"
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.data.model_dump_json(indent=1))
        os.replace(tmp, self.path)

    # ---- lookups ---------------------------------------------------------------------------------

    def by_name(self, name: str) -> Template | None:
        return next((t for t in self.data.templates.values() if t.name == name), None)

    def find(self, ref: str) -> tuple[Template, str | None] | None:
        """The template ``ref`` names (its id, its name, or ``name:tag``) and the tag it names, if any."""
        if ref in self.data.templates:
            return self.data.templates[ref], None
        name, tag = split_name(ref)
        template = self.by_name(name)
        return (template, tag) if template is not None else None

    def visible(self, ref: str, caller: Caller) -> tuple[Template, str | None]:
        """A template the caller may use; another tenant's is not found, as if it did not exist."""
        found = self.find(ref)
        if found is None or not caller.sees(found[0].owner):
            raise NotFound(f"no template {ref[:120]!r}")
        return found

    def own(self, ref: str, caller: Caller) -> tuple[Template, str | None]:
        template, tag = self.visible(ref, caller)
        if not caller.owns(template.owner):
            raise Forbidden(f"template {template.name!r} is the operator's: a tenant may use it, not change it")
        return template, tag

    def build_of(self, template: Template, tag: str | None) -> Build:
        """The build a tag names (none: E2B's default tag)."""
        tagged = template.tags.get(tag or DEFAULT_TAG)
        if tagged is None:
            raise NotFound(f"template {template.name!r} has no tag {tag or DEFAULT_TAG!r}")
        return template.builds[tagged.build]

    def image_for(self, ref: str) -> str | None:
        """The image a sandbox of ``ref`` runs (whoever asks: the image's owner decides who may use it);
        None: ``ref`` is no template's."""
        found = self.find(ref)
        if found is None:
            return None
        template, tag = found
        build = self.build_of(template, tag)
        if build.status != "ready":
            raise InvalidRequest(f"template {ref[:120]!r}: its build {build.id} is {build.status}, not ready")
        return template.image(build.id)

    # ---- changes ---------------------------------------------------------------------------------

    def new_build(self, name: str, tags: list[str], caller: Caller) -> tuple[Template, Build]:
        """A build of the template ``name`` (made now if new), to be tagged with ``tags`` when ready."""
        template = self.by_name(name)
        if template is None:
            if len(self.data.templates) >= MAX_TEMPLATES:
                raise InvalidRequest(f"this node holds {MAX_TEMPLATES} templates; delete some first")
            tid = "".join(secrets.choice(ID_ALPHABET) for _ in range(20))
            template = Template(id=tid, name=name, owner=caller.owner, created_at=now())
            self.data.templates[tid] = template
        elif not caller.owns(template.owner):
            raise TemplateTaken(f"template name {name!r} is taken; choose another")
        build = Build(id=str(uuid.uuid4()), created_at=now(), tags=tags)
        template.builds[build.id] = build
        self.save()
        return template, build

    def prune(self, template: Template) -> list[str]:
        """Forget the oldest finished builds no tag names, past MAX_BUILDS; the images of those that were
        ready, for the caller to remove."""
        tagged = {t.build for t in template.tags.values()}
        spare = [b for b in template.builds.values() if b.id not in tagged and b.status in ("ready", "error")]
        images = []
        for build in sorted(spare, key=lambda b: b.created_at)[: max(0, len(template.builds) - MAX_BUILDS)]:
            del template.builds[build.id]
            if build.status == "ready":
                images.append(template.image(build.id))
        self.save()
        return images

    def forget(self, template: Template, builds: list[str]) -> None:
        """Builds whose images are gone, and the tags that named them."""
        for build in builds:
            template.builds.pop(build, None)
        for tag in [t for t, tagged in template.tags.items() if tagged.build not in template.builds]:
            del template.tags[tag]
        self.save()

    def delete(self, template: Template) -> None:
        self.data.templates.pop(template.id, None)
        self.save()

    def finish(self, template: Template, build: Build, status: Status, reason: str | None, step: str | None) -> None:
        build.status, build.reason, build.step, build.finished_at = status, reason, step, now()
        if status == "ready":
            for tag in build.tags:
                template.tags[tag] = Tagged(build=build.id, at=now())
        self.save()

    def assign(self, template: Template, build: Build, tags: list[str]) -> None:
        for tag in tags:
            template.tags[tag] = Tagged(build=build.id, at=now())
        self.save()

    def remove_tags(self, template: Template, tags: list[str]) -> None:
        missing = [t for t in tags if t not in template.tags]
        if missing:
            raise NotFound(f"template {template.name!r} has no tag {missing[0][:80]!r}")
        for tag in tags:
            del template.tags[tag]
        self.save()
