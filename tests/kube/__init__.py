"""A real Kubernetes control plane for migpilot's tests: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and KWOK, built by scripts/k8s-tools and started on free
loopback ports by the `control_plane` fixture (tests/conftest.py); Prometheus, KEDA and
Karpenter's KWOK provider beside it for the tests that need them."""
