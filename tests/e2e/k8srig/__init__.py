"""k8srig: the e2e rig — a real Kubernetes 1.20 control plane on loopback plus a local kubelet (the pod
runner) that runs pods as processes, each on its own 127.N.x.y address. Test infrastructure only; it never
imports the product.

    from k8srig import Rig, ensure_binaries
    with Rig(ensure_binaries()) as rig:
        client = rig.client        # k8srig.kube.Client, or use rig.kubeconfig with kubectl / kopf
"""
from .assets import Binaries, BuildFailed, Unavailable, ensure_binaries
from .controlplane import Rig

__all__ = ["Binaries", "BuildFailed", "Rig", "Unavailable", "ensure_binaries"]
