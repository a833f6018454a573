"""What a ModelServer may ask of the cluster: the rules that keep a tenant inside its own namespace and pool.

Whoever may create a ModelServer makes the operator create pods with the operator's permissions, so a
ModelServer must not reach further than its author could with pods of their own:

- No node access. A `model.hostPath` volume mounts a node directory (any one, `/` included) into the pod; it
  is refused unless the operator runs with `--allow-host-path` (then every use is logged). The CRD has no
  field for securityContext, hostNetwork, hostPID/IPC, privileged or other volume types, the API server
  prunes unknown fields, and the operator builds pod specs from named fields only — so nothing else reaches
  the node. (A `model.image` volume is an OCI image mounted read-only and noexec: data, not a program.)
- No foreign programs. `spec.image` replaces the kvgate image the pods run; it is refused unless it is the
  operator's own engine image or starts with a prefix of `--allow-image-prefix` (each use logged; `*`
  allows any image). A prefix matches at a boundary: `registry.example/kvgate` allows
  `registry.example/kvgate:1.2` and `registry.example/kvgate/gpu:1`, not `registry.example/kvgate-evil:1`.
- No foreign pools. A pool routes to every pod in its namespace that matches its selector, so pod labels that
  match another InferencePool's selector would send that pool's prompts to these pods: refused
  (`JoinsOtherPool`), whether the labels come from `podLabels` or from the ModelServer's own pool's selector
  (a tenant may also create pools). `podLabels` may not change the labels the operator sets itself
  (`ReservedLabel`): the pool's selector and the app.kubernetes.io/* labels by which it finds its objects.
- Secrets only by reference, only their own namespace's. `engine.apiKeySecretRef` names a Secret key the kubelet
  puts in the engine's environment (VLLM_API_KEY); a pod can only reference Secrets of its own namespace, which is
  the ModelServer's, and the operator never reads one. That is no more than a pod of the author's own could do
  (mount any Secret of its namespace). The kvgate engine only compares requests' tokens with it and never logs
  or returns it; an image allowed by `--allow-image-prefix` runs other code with it, so that use is logged.

Every refusal is a problem ({reason, message}) that becomes the ModelServer's Ready=False condition; the
operator then writes nothing, so a Deployment made from an earlier, allowed spec keeps serving.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.operator import naming

ANY_IMAGE = "*"


@dataclass(frozen=True)
class TenantPolicy:
    """What the operator's flags allow ModelServers beyond the default (nothing)."""
    allow_host_path: bool = False
    image_prefixes: tuple[str, ...] = ()  # --allow-image-prefix; "*" allows any image


def image_allowed(image: str, prefixes: tuple[str, ...], operator_image: str | None) -> bool:
    """Whether `image` may run in engine pods: the operator's own engine image, or one under a prefix."""
    if image == operator_image:
        return True
    for prefix in prefixes:
        if prefix == ANY_IMAGE or image == prefix:
            return True
        if prefix and image.startswith(prefix) and (prefix[-1] in "/:@" or image[len(prefix)] in "/:@"):
            return True
    return False


def escalation_problems(ms: dict, policy: TenantPolicy, operator_image: str | None) -> list[dict]:
    """Host mounts and image overrides the policy does not allow."""
    spec = ms.get("spec") or {}
    problems = []
    host_path = ((spec.get("model") or {}).get("hostPath") or {}).get("path")
    if host_path and not policy.allow_host_path:
        problems.append({"reason": "HostPathNotAllowed",
                         "message": f"model.hostPath {host_path!r} would mount a node directory into the pods; "
                                    "the operator allows it only when started with --allow-host-path "
                                    "(use a pvc or image model volume)"})
    image = spec.get("image")
    if image and not image_allowed(str(image), policy.image_prefixes, operator_image):
        allowed = ", ".join(policy.image_prefixes) or "none"
        problems.append({"reason": "ImageNotAllowed",
                         "message": f"spec.image {image!r} is not the operator's engine image and matches no "
                                    f"--allow-image-prefix (allowed prefixes: {allowed})"})
    return problems


def privileged_uses(ms: dict, operator_image: str | None) -> list[str]:
    """What an allowed ModelServer uses beyond the default (for the operator's log)."""
    spec = ms.get("spec") or {}
    uses = []
    host_path = ((spec.get("model") or {}).get("hostPath") or {}).get("path")
    if host_path:
        uses.append(f"hostPath {host_path}")
    if spec.get("image") and spec["image"] != operator_image:
        uses.append(f"image {spec['image']}")
        ref = (spec.get("engine") or {}).get("apiKeySecretRef")
        if ref:  # that image's code reads the Secret's value: on record, as the image is
            uses.append(f"Secret {ref.get('name')!r} (key {ref.get('key')!r}) in that image's environment")
    return uses


def _selector(pool: dict) -> dict[str, str]:
    return dict(((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {})


def label_problems(ms: dict, operator_labels: dict[str, str], pod_labels: dict[str, str],
                   other_pools: list[dict]) -> list[dict]:
    """`podLabels` that change the operator's labels, and pod labels (`pod_labels`, final) that another pool
    of the namespace selects. `operator_labels`: the labels the operator sets (its own and the pool's)."""
    asked = (ms.get("spec") or {}).get("podLabels") or {}
    problems = []
    changed = sorted(k for k, v in asked.items() if k in operator_labels and operator_labels[k] != v)
    if changed:
        problems.append({"reason": "ReservedLabel",
                         "message": "podLabels may not change the labels the operator sets: "
                                    + ", ".join(f"{k}={asked[k]!r} (the operator sets {operator_labels[k]!r})"
                                                for k in changed)})
    ns = naming.namespace_of(ms)
    for pool in sorted(other_pools, key=naming.name_of):
        selector = _selector(pool)
        if naming.namespace_of(pool) != ns or not selector:
            continue
        if all(pod_labels.get(k) == v for k, v in selector.items()):
            problems.append({"reason": "JoinsOtherPool",
                             "message": f"the engine pods' labels match the selector of InferencePool "
                                        f"{naming.name_of(pool)!r} ({naming.selector_string(selector)}), so "
                                        "that pool would route its requests to them; change podLabels or the "
                                        "pool's selector"})
    return problems
