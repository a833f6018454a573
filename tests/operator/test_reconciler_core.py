"""The reconciler's core without a cluster: dispatch by kind, kopf's temporary vs permanent failures around each
object (reconciler.py, failures.py), and the pool reconciler parsing each EndpointPickerConfig once."""

import copy
import logging
from collections import Counter

import kopf
import pytest

from kvgate.operator import pool as p
from kvgate.operator.apply import MODELSERVER, POOL, ApiError
from kvgate.operator.config import OperatorConfig
from kvgate.operator.failures import PermanentFailureLog
from kvgate.operator.reconciler import Reconciler
from tests.operator.memory_kube import MemoryKube

IMAGE = "ghcr.io/kvgate/kvgate:0.1.0"


class ListOnlyKube:
    """Lists ModelServers and pools, for the keys that fan out over a namespace."""

    def __init__(self, modelservers=(), pools=()):
        self.objects = {MODELSERVER: list(modelservers), POOL: list(pools)}

    def list(self, kind, namespace=None, **_):
        return self.objects[kind]


class FakeKindReconciler:
    def __init__(self, failures=None):
        self.failures, self.reconciled, self.reported = failures or {}, [], []

    def reconcile(self, ns, name):
        self.reconciled.append(name)
        if name in self.failures:
            raise self.failures[name]

    def report_failure(self, ns, name, failure):
        self.reported.append((name, type(failure)))


def _obj(name, annotations=None):
    return {"metadata": {"name": name, "namespace": "default", "annotations": annotations or {}}}


def _reconciler(kube, modelservers=None, pools=None):
    reconciler = Reconciler(kube, OperatorConfig("e", "p", "v"))
    reconciler.modelservers, reconciler.pools = modelservers or FakeKindReconciler(), pools or FakeKindReconciler()
    return reconciler


def test_keys_dispatch_to_their_kinds_and_fan_out():
    ms, pools = FakeKindReconciler(), FakeKindReconciler()
    kube = ListOnlyKube([_obj("a"), _obj("b")], [_obj("x", {p.CONFIG_ANNOTATION: "cfg"}), _obj("y")])
    reconciler = _reconciler(kube, ms, pools)
    for key in [("ModelServer", "default", "a"), ("PoolMembers", "default", "x"), ("ConfigUsers", "default", "cfg"),
                ("InferencePool", "default", "y")]:
        assert reconciler.process(key) is None
    assert ms.reconciled == ["a", "a", "b"] and pools.reconciled == ["x", "y"]
    with pytest.raises(ValueError, match="unknown key"):
        reconciler.reconcile(("Nope",))


def test_a_permanent_failure_is_the_objects_report_a_temporary_one_retries_the_key():
    ms = FakeKindReconciler({"a": ApiError(403, "PATCH", "/x"), "b": ApiError(503, "GET", "/x")})
    reconciler = _reconciler(ListOnlyKube([_obj("a"), _obj("b"), _obj("c")]), ms)
    # a permanent failure is the object's condition and the next goes on; a temporary one retries the whole key
    assert reconciler.process(("PoolMembers", "default", "pool")) == 1.0
    assert ms.reconciled == ["a", "b"] and ms.reported == [("a", kopf.PermanentError)]
    assert reconciler.process(("ModelServer", "default", "b")) == 1.0  # its own key: its own backoff
    assert reconciler.process(("PoolMembers", "default", "pool")) == 2.0


def test_permanent_failures_are_logged_once_per_object_and_message(caplog):
    log = PermanentFailureLog()
    refused = kopf.PermanentError("HTTP 403")
    refused.__cause__ = ApiError(403, "PATCH", "/x")
    bug = kopf.PermanentError("boom")
    bug.__cause__ = KeyError("boom")
    with caplog.at_level(logging.ERROR, logger="kvgate.operator"):
        log.log(("ModelServer", "default", "a"), refused)
        log.log(("ModelServer", "default", "a"), refused)  # the resync meets it again
        log.log(("ModelServer", "default", "b"), refused)  # another object
        log.log(("ModelServer", "default", "a"), bug)  # another message
        log.clear(("ModelServer", "default", "a"))  # it reconciled: the next failure is news again
        log.log(("ModelServer", "default", "a"), bug)
        log.log(("PoolMembers", "default", "p"), bug, memo=("key", "PoolMembers", "default", "p"))
    lines = [r for r in caplog.records if "failed permanently" in r.message]
    assert [r.message.split(" failed")[0] for r in lines] == [
        "reconcile ModelServer/default/a", "reconcile ModelServer/default/b", "reconcile ModelServer/default/a",
        "reconcile ModelServer/default/a", "reconcile PoolMembers/default/p"]
    assert lines[0].exc_info is None and lines[2].exc_info[0] is KeyError  # the API server's answer: no traceback


TUNED = p.DEFAULT_EPP_CONFIG.replace("weight: 3", "weight: 7")


@pytest.mark.parametrize("referenced", ["tuned", None])
def test_a_pool_reconcile_parses_each_epp_config_once(samples, monkeypatch, referenced):
    kube = MemoryKube()
    pool = copy.deepcopy(samples["InferencePool"])
    if referenced:
        pool["metadata"]["annotations"] = {p.CONFIG_ANNOTATION: referenced}
        kube.put({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": referenced, "namespace": "default"},
                  "data": {"epp.yaml": TUNED}})
    for obj in (pool, samples["ModelServer"]):
        kube.put(obj)
    expected = TUNED if referenced else p.default_epp_config(pool, [samples["ModelServer"]]).config_yaml
    parsed, parse = Counter(), p.parse_config

    def counting_parse(text, *args, **kwargs):
        parsed[text] += 1
        return parse(text, *args, **kwargs)

    monkeypatch.setattr(p, "parse_config", counting_parse)
    Reconciler(kube, OperatorConfig(IMAGE, IMAGE, "envoy:test")).reconcile_pool("default", "demo-pool")
    assert kube.stored("ConfigMap", "demo-pool-epp")["data"]["epp.yaml"] == expected
    assert parsed == Counter({expected: 1})  # chosen, tokenizer and objects from one parse
