"""The shared Kubernetes boundary: the in-memory API server's semantics, the selectors, the
request bodies and the translation of lightkube's errors."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx2
import lightkube
import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot.kube import client, errors, memory, objects, requests

K = objects.Kind


def _pod(name: str, node: str = "", **labels: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": dict(labels)},
        "spec": {"nodeName": node} if node else {},
    }


def test_every_write_bumps_one_version_shared_by_every_kind() -> None:
    server = memory.InMemoryServer()
    assert server.version == "0"
    server.put(K.NODES, {"metadata": {"name": "n0"}})
    server.put(K.PODS, _pod("p"))
    server.delete(K.PODS, "ns/p")
    server.delete(K.PODS, "ns/p")  # nothing to delete: no version
    assert server.version == "3"
    assert server.list(K.NODES).items[0]["metadata"]["resourceVersion"] == "1"
    assert server.list(K.PODS) == objects.Listed((), "3")


def test_a_read_hands_out_a_copy() -> None:
    server = memory.InMemoryServer()
    server.put(K.PODS, _pod("p"))
    got = server.get(K.PODS, "p", namespace="ns")
    assert got is not None
    got["spec"]["nodeName"] = "changed"
    assert server.objects[K.PODS]["ns/p"]["spec"] == {}
    assert server.get(K.PODS, "p", namespace="other") is None
    assert server.requests["get", K.PODS] == 2


def test_a_watch_sees_objects_start_and_stop_matching_its_selectors() -> None:
    server = memory.InMemoryServer()
    server.put(K.PODS, _pod("a"))
    version = server.list(K.PODS, fields=(objects.on_node("n0"),)).resource_version
    server.put(K.PODS, _pod("a", "n0"))  # bound: it starts matching
    server.put(K.PODS, _pod("b", "n1"))  # another node: never seen
    server.put(K.PODS, _pod("a", "n0", tier="x"))
    server.delete(K.PODS, "ns/a")
    server.close()
    seen = [
        (e.type, e.object["metadata"]["name"])
        for e in server.watch(K.PODS, resource_version=version, fields=(objects.on_node("n0"),))
    ]
    assert seen == [
        (objects.EventType.ADDED, "a"),
        (objects.EventType.MODIFIED, "a"),
        (objects.EventType.DELETED, "a"),
    ]


def test_a_deleted_object_carries_the_deletions_version() -> None:
    server = memory.InMemoryServer()
    server.put(K.NODES, {"metadata": {"name": "n0"}})
    server.delete(K.NODES, "n0")
    server.close()
    (_, deleted) = list(server.watch(K.NODES, resource_version="0"))
    assert deleted.type is objects.EventType.DELETED
    assert deleted.object["metadata"]["resourceVersion"] == "2"


def test_a_watch_from_before_a_compaction_is_gone() -> None:
    server = memory.InMemoryServer()
    server.put(K.NODES, {"metadata": {"name": "n0"}})
    server.compact()
    with pytest.raises(errors.GoneError):
        next(iter(server.watch(K.NODES, resource_version="0")))
    server.close()
    assert list(server.watch(K.NODES, resource_version=server.version)) == []


def test_a_thread_blocked_in_a_watch_wakes_at_the_next_change_and_at_close() -> None:
    server = memory.InMemoryServer()
    got: list[str] = []

    def follow() -> None:
        for event in server.watch(K.NODES, resource_version="0"):
            got.append(objects.name_of(event.object))

    thread = threading.Thread(target=follow)
    thread.start()
    server.put(K.NODES, {"metadata": {"name": "n0"}})
    server.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and got == ["n0"]


def test_an_async_watch_is_woken_by_writes_and_ends_at_close() -> None:
    server = memory.InMemoryServer()

    async def main() -> list[str]:
        got: list[str] = []

        async def follow() -> None:
            async for event in server.watch_async(K.LAYOUTS, resource_version="0"):
                got.append(objects.name_of(event.object))

        task = asyncio.create_task(follow())
        await asyncio.sleep(0)
        server.put(K.LAYOUTS, {"metadata": {"name": "n0"}})
        server.put(K.NODES, {"metadata": {"name": "n0"}})  # another kind: not seen
        server.put(K.LAYOUTS, {"metadata": {"name": "n1"}})
        await asyncio.sleep(0.05)
        server.close()
        await asyncio.wait_for(task, 10)
        return got

    assert asyncio.run(main()) == ["n0", "n1"]


def test_replay_delivers_an_old_object_without_storing_it() -> None:
    server = memory.InMemoryServer()
    old = server.put(K.PODS, _pod("p"))
    server.put(K.PODS, _pod("p", "n0"))
    server.replay(K.PODS, old)
    server.close()
    events = list(server.watch(K.PODS, resource_version="2"))
    assert [e.object["metadata"]["resourceVersion"] for e in events] == ["1"]
    assert server.objects[K.PODS]["ns/p"]["spec"] == {"nodeName": "n0"}


def test_create_and_replace_refuse_as_the_api_server_does() -> None:
    server = memory.InMemoryServer()
    lease = {"metadata": {"name": "l", "namespace": "ns"}, "spec": {}}
    made = server.create(K.LEASES, lease)
    with pytest.raises(errors.ConflictError):
        server.create(K.LEASES, lease)
    assert server.create(K.LEASES, {**lease, "metadata": {"name": "m", "namespace": "ns"}},
                         dry_run=True)  # fmt: skip
    assert "ns/m" not in server.objects[K.LEASES]
    with pytest.raises(errors.ConflictError):
        server.replace(K.LEASES, lease)  # no resourceVersion: not the stored one
    replaced = server.replace(K.LEASES, {**made, "spec": {"holderIdentity": "c"}})
    assert replaced["metadata"]["resourceVersion"] != made["metadata"]["resourceVersion"]
    with pytest.raises(errors.KubeApiError, match="404"):
        server.replace(K.LEASES, {"metadata": {"name": "x", "namespace": "ns"}})


def test_update_writes_only_a_change() -> None:
    server = memory.InMemoryServer()
    server.put(K.NODES, {"metadata": {"name": "n0", "labels": {"a": "1"}}})
    same = server.update(K.NODES, "n0", lambda d: d)
    assert same is not None and server.version == "1"

    def relabel(doc: dict[str, Any] | None) -> dict[str, Any] | None:
        assert doc is not None
        return memory.merge_patch(doc, requests.node_labels_patch({"a": None, "b": "2"}))

    after = server.update(K.NODES, "n0", relabel)
    assert after is not None and after["metadata"]["labels"] == {"b": "2"}
    assert server.version == "2"


@given(
    st.dictionaries(st.sampled_from("abc"), st.one_of(st.none(), st.sampled_from("xy"))),
    st.dictionaries(st.sampled_from("abc"), st.sampled_from("xy")),
)
def test_a_merge_patch_sets_and_removes_keys_and_keeps_the_others(
    patch: dict[str, str | None], labels: dict[str, str]
) -> None:
    doc = {"metadata": {"name": "n", "labels": labels}, "spec": {"k": 1}}
    out = memory.merge_patch(doc, requests.node_labels_patch(patch))
    want = {k: v for k, v in {**labels, **patch}.items() if v is not None}
    assert out["metadata"]["labels"] == want
    assert out["spec"] == {"k": 1} and doc["metadata"]["labels"] == labels


@pytest.mark.parametrize(
    ("selector", "doc", "selected"),
    [
        (objects.on_node(None), {"spec": {"nodeName": "n0"}}, True),
        (objects.on_node(None), {"spec": {}}, False),
        (objects.on_node(None), {}, False),
        (objects.on_node("n0"), {"spec": {"nodeName": "n0"}}, True),
        (objects.on_node("n0"), {"spec": {"nodeName": "n1"}}, False),
        (objects.named("a"), {"metadata": {"name": "a"}}, True),
        (objects.named("a"), {"metadata": {"name": "b"}}, False),
    ],
)
def test_field_selectors_select_as_the_api_server(
    selector: objects.FieldSelector, doc: dict[str, Any], selected: bool
) -> None:
    assert selector.matches(doc) is selected


def test_the_event_body_names_its_object_and_cuts_the_message() -> None:
    note = objects.EventNote("Pod", "ns", "p", "u1", "Warning", "Unplaceable", "x" * 2000)
    body = requests.event_body(note, component="migpilot-controller", stamp="2024-01-01T00:00:00Z")
    assert body["metadata"] == {"generateName": "p.", "namespace": "ns"}
    assert body["involvedObject"]["uid"] == "u1"
    assert len(body["message"]) == requests.EVENT_MESSAGE_CHARS
    node_note = objects.EventNote("Node", None, "n0", "u2", "Normal", "Planned", "ok")
    assert requests.event_body(node_note, component="c", stamp="s")["metadata"]["namespace"] == (
        "default"
    )


def test_an_unreachable_server_is_a_transient_error_naming_what_failed() -> None:
    err = client.translate(httpx2.ConnectError("[Errno 111] Connection refused"))
    assert err.transient and err.code is None
    assert str(err) == "the API server cannot be reached: [Errno 111] Connection refused"
    silent = client.translate(httpx2.ReadTimeout(""))
    assert "ReadTimeout" in str(silent)


@pytest.mark.parametrize(
    ("code", "kind", "transient"),
    [
        (410, errors.GoneError, False),
        (409, errors.ConflictError, False),
        (404, errors.NotFoundError, False),
        (403, errors.KubeApiError, False),
        (429, errors.KubeApiError, True),
        (503, errors.KubeApiError, True),
    ],
)
def test_the_api_servers_refusals_keep_its_message(
    code: int, kind: type[errors.KubeApiError], transient: bool
) -> None:
    status = {"kind": "Status", "code": code, "reason": "Why", "message": "what happened"}
    request = httpx2.Request("GET", "https://apiserver")
    refused = lightkube.ApiError(response=httpx2.Response(code, json=status, request=request))
    err = client.translate(refused)
    assert type(err) is kind and err.transient is transient
    assert err.code == code
    assert str(err) == f"{code} Why: what happened"


def test_resource_claims_are_read_as_resource_k8s_io_v1_with_their_allocation() -> None:
    """The DRA plugin reads what kube-scheduler wrote: the typed model keeps every field of a
    result the plugin reads (a field dropped here would be a claim the plugin misreads)."""
    res = client.RESOURCES[objects.Kind.RESOURCECLAIMS]
    assert objects.Kind.RESOURCECLAIMS.namespaced
    assert (res._api_info.resource.group, res._api_info.resource.version) == (
        "resource.k8s.io",
        "v1",
    )
    result = {
        "request": "gpu/small",
        "driver": "mig.migpilot.io",
        "pool": "node-a",
        "device": "gpu-0-mig-1g-10gb-0",
        "shareID": "s-1",
        "adminAccess": False,
    }
    doc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": "c", "uid": "u1"},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }
    assert res.from_dict(doc).to_dict() == doc
