"""ModelServer's engine.quantization and engine.tensorParallelSize: the engine flags, the GPUs each pod requests,
the shared-memory volume the ranks need, and the specs that cannot work as conditions rather than Deployments."""

import copy

import pytest

from kvgate.operator import modelserver as m

IMAGE = "kvgate:test"


def _render(samples, engine=None, resources=None, extra=None):
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["engine"] = {**(ms["spec"].get("engine") or {}), **(engine or {})}
    if resources is not None:
        ms["spec"]["resources"] = resources
    if extra is not None:
        ms["spec"]["extraArgs"] = extra
    pool = samples["InferencePool"]
    return ms, pool, m.desired_engine_deployment(ms, pool, IMAGE)


def _container(dep):
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def _flag(command, name):
    return command[command.index(name) + 1] if name in command else None


def test_tensor_parallel_pods_request_one_gpu_a_rank_and_get_a_shared_memory_volume(samples):
    _, _, dep = _render(samples, engine={"backend": "torch", "device": "cuda", "tensorParallelSize": 4,
                                         "quantization": "fp8"},
                        resources={"limits": {"memory": "64Gi"}, "requests": {"cpu": "8"}})
    c = _container(dep)
    assert _flag(c["command"], "--tensor-parallel-size") == "4"
    assert _flag(c["command"], "--quantization") == "fp8"
    assert c["resources"]["limits"] == {"memory": "64Gi", m.GPU_RESOURCE: "4"}
    assert c["resources"]["requests"] == {"cpu": "8"}  # an extended resource's request defaults to its limit
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": m.SHM_SIZE}} in pod["volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_user_resources_are_not_changed_in_place(samples):
    ms, pool, _ = _render(samples, engine={"tensorParallelSize": 2}, resources={"limits": {"memory": "1Gi"}})
    assert ms["spec"]["resources"] == {"limits": {"memory": "1Gi"}}
    dep = m.desired_engine_deployment(ms, pool, IMAGE)
    assert _container(dep)["resources"]["limits"][m.GPU_RESOURCE] == "2"  # the default device (auto)


def test_a_gpu_count_equal_to_the_ranks_is_accepted(samples):
    _, _, dep = _render(samples, engine={"tensorParallelSize": 2},
                        resources={"limits": {m.GPU_RESOURCE: 2}, "requests": {m.GPU_RESOURCE: "2"}})
    assert _container(dep)["resources"]["limits"][m.GPU_RESOURCE] == "2"


def test_cpu_ranks_request_no_gpu(samples):
    _, _, dep = _render(samples, engine={"device": "cpu", "tensorParallelSize": 2})
    c = _container(dep)
    assert _flag(c["command"], "--tensor-parallel-size") == "2"
    assert m.GPU_RESOURCE not in (c.get("resources") or {}).get("limits", {})
    assert any(v["mountPath"] == "/dev/shm" for v in c["volumeMounts"])  # gloo's ranks share memory too


def test_one_rank_renders_as_before(samples):
    _, _, plain = _render(samples)
    _, _, one = _render(samples, engine={"tensorParallelSize": 1})
    c_plain, c_one = _container(plain), _container(one)
    assert "--tensor-parallel-size" not in c_plain["command"] and "--quantization" not in c_plain["command"]
    assert _flag(c_one["command"], "--tensor-parallel-size") == "1"
    assert c_one.get("resources") == c_plain.get("resources")
    assert c_one["volumeMounts"] == c_plain["volumeMounts"]


@pytest.mark.parametrize("engine,resources,says", [
    ({"tensorParallelSize": 4}, {"limits": {m.GPU_RESOURCE: "2"}}, "resources.limits[nvidia.com/gpu] is '2'"),
    ({"tensorParallelSize": 2}, {"requests": {m.GPU_RESOURCE: 1}}, "resources.requests[nvidia.com/gpu] is 1"),
    ({"tensorParallelSize": 2, "device": "cuda:1"}, None, "names one GPU"),
    ({"quantization": "int3"}, None, "quantization 'int3' is not one of"),
])
def test_specs_that_cannot_work_are_a_condition(samples, engine, resources, says):
    ms, pool, dep = _render(samples, engine=engine, resources=resources)
    assert dep is None
    (problem,) = [p for p in m.validate_modelserver(ms, pool) if says in p["message"]]
    assert problem["reason"] == "InvalidSpec"
    ready = m.modelserver_status(ms, None, pool)["conditions"][0]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "InvalidSpec")


@pytest.mark.parametrize("extra", [["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"], ["--tensor", "2"],
                                   ["--quantization", "awq"], ["--quant=gptq"]])
def test_extra_args_may_not_set_what_a_spec_field_owns(samples, extra):
    ms, pool, dep = _render(samples, extra=extra)
    assert dep is None
    assert any("extraArgs may not set" in p["message"] for p in m.validate_modelserver(ms, pool))


@pytest.mark.parametrize("engine", [{"tensorParallelSize": 0}, {"tensorParallelSize": 17},
                                    {"tensorParallelSize": "2"}, {"quantization": 8}])
def test_wrong_shapes_are_a_condition(samples, engine):
    ms, pool, dep = _render(samples, engine=engine)
    assert dep is None and m.validate_modelserver(ms, pool)[0]["reason"] == "InvalidSpec"


def test_the_engine_parser_takes_the_rendered_flags(samples):
    import argparse

    from kvgate.engine.cli_args import add_engine_args, engine_config_from_args

    _, _, dep = _render(samples, engine={"backend": "torch", "device": "cpu", "tensorParallelSize": 2,
                                         "quantization": "gptq"})
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    for flag in ("--host", "--port", "--shutdown-timeout"):
        parser.add_argument(flag)
    add_engine_args(parser)
    args = parser.parse_args(_container(dep)["command"][2:])
    config = engine_config_from_args("/model", args)
    assert (config.tensor_parallel_size, config.quantization, config.device) == (2, "gptq", "cpu")
