"""dmtd_operator: the Kubernetes operator of the DMTD serving platform.

Reconciles `DMTDDeployment` objects (serving.dmtd.dev/v1alpha1) into KubeRay RayServices, a gateway
Service and registry entries, and scales them on latency SLOs with a tau-aware policy. Imports no torch
and no Ray. Run it with `kopf run -m dmtd_operator.handlers --all-namespaces`.
"""

__version__ = "0.1.0"
