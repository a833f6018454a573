from kvgate.operator import naming


def test_long_names_stay_dns_labels_and_unique():
    a = naming.epp_name({"metadata": {"name": "x" * 70}})
    b = naming.epp_name({"metadata": {"name": "x" * 71}})
    assert len(a) <= 63 and len(b) <= 63 and a != b


def test_owner_reference_and_ownership():
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"}}
    ref = naming.owner_reference(pool)
    assert ref == {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "name": "p",
                   "uid": "u1", "controller": True, "blockOwnerDeletion": True}
    obj = {"metadata": naming.object_meta("s", pool, naming.component_labels("epp", "p"))}
    assert naming.is_managed(obj) and naming.is_owned_by(obj, pool)
    other = {**pool, "metadata": {**pool["metadata"], "uid": "u2"}}
    assert not naming.is_owned_by(obj, other)
    assert not naming.is_managed({"metadata": {}}) and not naming.is_owned_by(None, pool)


def test_selector_string_is_sorted():
    assert naming.selector_string({"b": "2", "a": "1"}) == "a=1,b=2"
