"""NVIDIA's device-plugin config file (``version: v1``), parsed and checked as NVIDIA's plugin does.

The file users already hand to NVIDIA's plugin with ``--config-file`` (k8s-device-plugin
``api/config/v1``): ``version``, ``flags`` (``migStrategy``, ``mpsRoot``; other flags are read by
NVIDIA's plugin and ignored here), and ``sharing.timeSlicing`` / ``sharing.mps`` with
``renameByDefault``, ``failRequestsGreaterThanOne`` and ``resources[{name, rename?, devices?,
replicas}]``. Validation follows NVIDIA's ``UnmarshalJSON`` rules and messages (``no resources
specified``, ``number of replicas must be >= 2``, ``devices set as 'x' but the only valid string
input is 'all'``, resource-name format, ``unknown version``), each prefixed with the field's path
(``sharing.timeSlicing.resources[0].replicas: number of replicas must be >= 2``). migpilot is
stricter in a few places where NVIDIA's plugin accepts a file and then silently does something
else (each listed in ``docs/sharing.md``): a resource name no plugin advertises, duplicate YAML
keys, MPS replicas over 48 (NVIDIA's MPS daemon refuses them later), time-slicing replicas over
:data:`MAX_REPLICAS` (NVIDIA has no cap; every replica is a device the plugin lists and the
kubelet tracks), a rename onto a resource the
plugin advertises itself, and one resource shared twice with overlapping ``devices: all`` or
``count``. What NVIDIA's plugin ignores with a warning (the top-level ``resources`` section,
``sharing.timeSlicing`` beside ``sharing.mps``) is kept in :attr:`Config.warnings`.

Pure: text in, frozen values out; reading the file is the shell's job.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from migpilot import errors, yamltext

VERSION = "v1"
RESOURCE_PREFIX = "nvidia.com"
SHARED_SUFFIX = ".shared"
"""NVIDIA's ``DefaultSharedResourceNameSuffix``: what ``renameByDefault`` appends."""
MAX_RESOURCE_NAME = 63
"""NVIDIA's ``MaxResourceNameLength`` for a fully qualified resource name."""
MPS_MAX_CLIENTS = 48
"""Most clients one MPS server takes on Volta and newer (every MIG-capable GPU)."""
MAX_REPLICAS = 1024
"""Most time-slicing replicas of one device. NVIDIA's plugin has none, but each replica is one
device in the plugin's list and in the kubelet's checkpoint: ``replicas: 1e23`` (accepted before)
would never fit in memory. A node runs 110 pods by default and a few hundred at most, so no node
can use more than that many replicas of a GPU at once; 1024 leaves room to spare."""
MIG_STRATEGIES = ("none", "single", "mixed")

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_ADVERTISED = re.compile(r"^nvidia\.com/(gpu|mig-[0-9]+g\.[0-9]+gb([.+-][a-z]+)*)$")
"""The resources a device plugin advertises: whole GPUs and MIG profiles (``mig-1g.10gb.me``)."""


class SharingStrategy(enum.StrEnum):
    """The node's sharing strategy (the ``nvidia.com/gpu.sharing-strategy`` label values)."""

    NONE = "none"
    TIME_SLICING = "time-slicing"
    MPS = "mps"


@dataclass(frozen=True, slots=True)
class DeviceSelector:
    """Which devices of a resource are replicated (NVIDIA's ``ReplicatedDevices``): all of them,
    the first ``count``, or those ``refs`` names (GPU index ``"0"``, MIG index ``"0:1"``, or a
    ``GPU-``/``MIG-`` UUID)."""

    all: bool = True
    count: int = 0
    refs: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.all:
            return "all"
        if self.count:
            return str(self.count)
        return json.dumps(list(self.refs))


@dataclass(frozen=True, slots=True)
class ReplicatedResource:
    """One entry of ``resources``: a resource, its replicas, where they are advertised."""

    name: str
    """Fully qualified: ``nvidia.com/gpu``, ``nvidia.com/mig-1g.10gb``."""
    replicas: int
    """Replicas per device (at least 2)."""
    rename: str | None = None
    """Where the replicas are advertised instead of :attr:`name` (fully qualified)."""
    devices: DeviceSelector = DeviceSelector()

    @property
    def advertised_as(self) -> str:
        """The resource the replicas are advertised under."""
        return self.rename if self.rename is not None else self.name


@dataclass(frozen=True, slots=True)
class ReplicatedResources:
    """``sharing.timeSlicing`` or ``sharing.mps``."""

    resources: tuple[ReplicatedResource, ...]
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool | None = None
    """As written; ``None`` when absent (see :meth:`Config.fails_requests_greater_than_one`)."""


@dataclass(frozen=True, slots=True)
class Config:
    """A parsed config file. The empty config (no sharing) is ``Config()``."""

    mig_strategy: str | None = None
    """``flags.migStrategy`` (``none``, ``single``, ``mixed``) or ``None`` when absent."""
    mps_root: str | None = None
    """``flags.mpsRoot``: the host folder of the MPS daemons' pipe and log folders."""
    time_slicing: ReplicatedResources | None = None
    mps: ReplicatedResources | None = None
    warnings: tuple[str, ...] = ()
    """What NVIDIA's plugin would ignore with a warning, one line each."""

    @property
    def strategy(self) -> SharingStrategy:
        """NVIDIA's ``Sharing.SharingStrategy()``: MPS if set, else time-slicing if set."""
        if self.mps is not None:
            return SharingStrategy.MPS
        if self.time_slicing is not None:
            return SharingStrategy.TIME_SLICING
        return SharingStrategy.NONE

    @property
    def active(self) -> ReplicatedResources | None:
        """The resources replicated under :attr:`strategy` (NVIDIA's ``ReplicatedResources()``)."""
        return self.mps if self.mps is not None else self.time_slicing

    @property
    def fails_requests_greater_than_one(self) -> bool:
        """Whether a container asking for more than one replica is refused: as written, else
        ``true`` for MPS (NVIDIA keeps its historical MPS behaviour) and ``false`` otherwise."""
        active = self.active
        if active is None:
            return False
        if active.fail_requests_greater_than_one is not None:
            return active.fail_requests_greater_than_one
        return self.strategy is SharingStrategy.MPS

    def entries_for(self, name: str) -> tuple[ReplicatedResource, ...]:
        """The active entries sharing resource ``name``, in file order."""
        active = self.active
        if active is None:
            return ()
        return tuple(r for r in active.resources if r.name == name)

    def check_mig_strategy(self, strategy: str) -> None:
        """NVIDIA's start-up check: MPS is not supported with the mixed strategy."""
        if self.strategy is SharingStrategy.MPS and strategy == "mixed":
            raise errors.SharingConfigError(
                "sharing.mps: using --mig-strategy=mixed is not supported with MPS"
            )


EMPTY = Config()
"""No sharing: what an empty file, or NVIDIA's ``empty`` fallback, gives."""


def parse(text: str, *, source: str) -> Config:
    """Parse a config file's text (YAML or JSON); a :class:`SharingConfigError` naming ``source``
    and the field otherwise."""
    data = _load_yaml(text, source)
    try:
        return _config(data)
    except errors.SharingConfigError as err:
        raise errors.SharingConfigError(f"{source}: {err}") from None


def resource_name(text: str, *, path: str) -> str:
    """NVIDIA's ``NewResourceName``: prefix ``nvidia.com/`` when absent, at most 63 characters,
    the name part a DNS subdomain."""
    name = text if text.startswith(f"{RESOURCE_PREFIX}/") else f"{RESOURCE_PREFIX}/{text}"
    if len(name) > MAX_RESOURCE_NAME:
        raise _error(
            path,
            f"fully-qualified resource name must be {MAX_RESOURCE_NAME} characters or less: {name}",
        )
    part = name.split("/", 1)[1]
    if not _DNS_SUBDOMAIN.match(part) or len(part) > 253:
        raise _error(
            path,
            f"incorrect format for resource name '{name}': a lowercase RFC 1123 subdomain must "
            "consist of lower case alphanumeric characters, '-' or '.', and must start and end "
            "with an alphanumeric character",
        )
    return name


def is_device_ref(ref: str) -> bool:
    """A ``devices`` list entry NVIDIA accepts: GPU index, MIG index or GPU/MIG UUID."""
    return _is_index(ref) or _is_mig_index(ref) or _is_gpu_uuid(ref) or _is_mig_uuid(ref)


# --- the document ------------------------------------------------------------------------------


def _config(data: Any) -> Config:
    if data is None:
        return EMPTY
    doc = _mapping(data, "")
    version = doc.get("version", VERSION)
    if version in ("", None):
        version = VERSION
    if version != VERSION:
        raise _error("version", f"unknown version: {version}")
    warnings: list[str] = []
    mig_strategy = mps_root = None
    flags = doc.get("flags")
    if flags is not None:
        flags = _mapping(flags, "flags")
        if flags.get("migStrategy") is not None:
            mig_strategy = _string(flags["migStrategy"], "flags.migStrategy")
            if mig_strategy not in MIG_STRATEGIES:
                raise _error("flags.migStrategy", f"unknown MIG strategy: {mig_strategy}")
        if flags.get("mpsRoot") is not None:
            mps_root = _string(flags["mpsRoot"], "flags.mpsRoot")
    if doc.get("resources"):
        warnings.append(
            "resources: customizing the 'resources' field is not yet supported in the config; "
            "ignoring it (as NVIDIA's plugin)"
        )
    time_slicing = mps = None
    sharing = doc.get("sharing")
    if sharing is not None:
        sharing = _mapping(sharing, "sharing")
        if sharing.get("timeSlicing") is not None:
            time_slicing = _replicated(sharing["timeSlicing"], "sharing.timeSlicing", mps=False)
        if sharing.get("mps") is not None:
            mps = _replicated(sharing["mps"], "sharing.mps", mps=True)
    if mps is not None and time_slicing is not None:
        warnings.append("sharing.timeSlicing is ignored while sharing.mps is set (as NVIDIA's)")
    return Config(
        mig_strategy=mig_strategy,
        mps_root=mps_root,
        time_slicing=time_slicing,
        mps=mps,
        warnings=tuple(warnings),
    )


def _replicated(data: Any, path: str, *, mps: bool) -> ReplicatedResources:
    doc = _mapping(data, path)
    rename_by_default = _bool(doc.get("renameByDefault", False), f"{path}.renameByDefault")
    fail = doc.get("failRequestsGreaterThanOne")
    if fail is not None:
        fail = _bool(fail, f"{path}.failRequestsGreaterThanOne")
    raw = doc.get("resources")
    if raw is None:
        raise _error(path, "no resources specified")
    if not isinstance(raw, list):
        raise _error(f"{path}.resources", f"expected a list, got {_kind(raw)}")
    if not raw:
        raise _error(f"{path}.resources", "no resources specified")
    resources = tuple(
        _resource(item, f"{path}.resources[{n}]", rename_by_default=rename_by_default, mps=mps)
        for n, item in enumerate(raw)
    )
    _check_overlaps(resources, path)
    return ReplicatedResources(
        resources=resources,
        rename_by_default=rename_by_default,
        fail_requests_greater_than_one=fail,
    )


def _resource(data: Any, path: str, *, rename_by_default: bool, mps: bool) -> ReplicatedResource:
    doc = _mapping(data, path)
    if "name" not in doc:
        raise _error(path, "no resource name specified")
    name = resource_name(_string(doc["name"], f"{path}.name"), path=f"{path}.name")
    if not _ADVERTISED.match(name):
        raise _error(
            f"{path}.name",
            f"unknown resource {name}: the plugin advertises nvidia.com/gpu and "
            "nvidia.com/mig-<profile> (e.g. nvidia.com/mig-1g.10gb)",
        )
    devices = _devices(doc.get("devices", "all"), f"{path}.devices")
    if "replicas" not in doc:
        raise _error(path, "no replicas specified")
    replicas = doc["replicas"]
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise _error(f"{path}.replicas", f"expected an integer, got {_kind(replicas)}")
    if replicas < 2:
        raise _error(f"{path}.replicas", "number of replicas must be >= 2")
    if mps and replicas > MPS_MAX_CLIENTS:
        raise _error(
            f"{path}.replicas",
            "invalid MPS configuration: maximum allowed replicas exceeded: "
            f"{_shown_int(replicas)} > "
            f"{MPS_MAX_CLIENTS}",
        )
    if replicas > MAX_REPLICAS:
        raise _error(
            f"{path}.replicas",
            f"number of replicas must be <= {MAX_REPLICAS}, got {_shown_int(replicas)}: each "
            "replica is a device the plugin advertises and the kubelet tracks, and no node runs "
            f"more than a few hundred pods (110 by default) to use them",
        )
    rename = None
    if doc.get("rename") not in (None, ""):
        rename = resource_name(_string(doc["rename"], f"{path}.rename"), path=f"{path}.rename")
        if _ADVERTISED.match(rename):
            raise _error(
                f"{path}.rename",
                f"{rename} is a resource the plugin advertises itself; rename to another name "
                f"(e.g. {name}{SHARED_SUFFIX})",
            )
    elif rename_by_default:
        rename = name + SHARED_SUFFIX
    return ReplicatedResource(name=name, replicas=replicas, rename=rename, devices=devices)


def _devices(data: Any, path: str) -> DeviceSelector:
    if isinstance(data, str):
        if data != "all":
            raise _error(
                path,
                f"devices set as '{_plain(data)}' but the only valid string input is 'all'",
            )
        return DeviceSelector()
    if isinstance(data, int) and not isinstance(data, bool):
        if data <= 0:
            raise _error(
                path, f"devices set as '{_shown_int(data)}' but a count of devices must be > 0"
            )
        return DeviceSelector(all=False, count=data)
    if isinstance(data, list):
        refs: list[str] = []
        for n, item in enumerate(data):
            if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
                refs.append(str(item))
                continue
            if isinstance(item, str) and is_device_ref(item):
                refs.append(item)
                continue
            raise _error(
                f"{path}[{n}]",
                f"unsupported type for device in devices list: {_plain(item)}, "
                f"{_kind(item)} (a GPU index, a MIG index such as 0:1, or a GPU- or MIG- UUID)",
            )
        if not refs:
            raise _error(path, "unrecognized type for devices spec: []")
        if len(set(refs)) != len(refs):
            raise _error(path, "a device is listed twice")
        return DeviceSelector(all=False, refs=tuple(refs))
    raise _error(path, f"unrecognized type for devices spec: {_kind(data)}")


def _check_overlaps(resources: tuple[ReplicatedResource, ...], path: str) -> None:
    """One resource may be listed again only with ``devices`` lists (disjoint on the node)."""
    first: dict[str, int] = {}
    for n, r in enumerate(resources):
        if r.name not in first:
            first[r.name] = n
            continue
        m = first[r.name]
        if not r.devices.refs or not resources[m].devices.refs:
            raise _error(
                f"{path}.resources[{n}]",
                f"{r.name} is already shared by resources[{m}]; list it again only with "
                "devices lists that name different devices",
            )


# --- helpers -----------------------------------------------------------------------------------


def _load_yaml(text: str, source: str) -> Any:
    return yamltext.load(text, source=source, error=errors.SharingConfigError)


def _error(path: str, message: str) -> errors.SharingConfigError:
    return errors.SharingConfigError(f"{path}: {message}" if path else message)


def _plain(value: Any) -> str:
    """``value`` as NVIDIA's ``%v`` shows it (a string unquoted), cut short
    (:func:`errors.shown`): a user's value is quoted, never echoed whole."""
    if isinstance(value, str):
        cut = errors.SHOWN_CHARS
        return value if len(value) <= cut else value[: cut - 3] + "..."
    return errors.shown(value)


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"a string ({errors.shown(value)})"
    return f"{type(value).__name__} {errors.shown(value)}"


def _shown_int(value: int) -> str:
    """``value`` for a message, short even for a number of thousands of digits (turning one of
    over 4,300 digits into a string raises ValueError)."""
    return str(value) if value.bit_length() <= 64 else "a number over 2^64"


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _error(path, f"expected a mapping, got {_kind(value)}")
    return value


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _error(path, f"expected a string, got {_kind(value)}")
    return value


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise _error(path, f"expected true or false, got {_kind(value)}")
    return value


def _is_index(ref: str) -> bool:
    return ref.isdigit() and ref.isascii()


def _is_mig_index(ref: str) -> bool:
    parts = ref.split(":", 1)
    return len(parts) == 2 and all(_is_index(p) for p in parts)


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def _is_gpu_uuid(ref: str) -> bool:
    return ref.startswith("GPU-") and _is_uuid(ref[4:])


def _is_mig_uuid(ref: str) -> bool:
    if not ref.startswith("MIG-"):
        return False
    suffix = ref[4:]
    if _is_uuid(suffix):
        return True
    parts = suffix.split("/")
    return len(parts) == 3 and _is_gpu_uuid(parts[0]) and all(_is_index(p) for p in parts[1:])
