"""The chart runs the images `make images` builds: same names, tagged with the chart's appVersion."""

from __future__ import annotations

import pytest
import yaml

from dmtd_operator import __version__
from dmtd_operator.spec import SERVING_IMAGE
from tests.images.chart import default_deployment, operator_container, render_default
from tests.images.podman import CHART, ROOT, chart_tag, image_name


def test_build_script_tags_with_the_charts_app_version() -> None:
    script = (ROOT / "scripts" / "build-images.sh").read_text()
    assert 'ghcr.io/dmtd/$name:$TAG' in script and "appVersion" in script
    assert "for name in ${IMAGES:-operator serving}" in script
    assert chart_tag() == __version__  # the operator package, the chart's appVersion and the image tags agree


def test_chart_and_crd_defaults_name_the_built_images() -> None:
    assert image_name("serving") == SERVING_IMAGE
    crd = yaml.safe_load((CHART / "crds" / "dmtddeployments.serving.dmtd.dev.yaml").read_text())
    serving = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["serving"]
    assert serving["properties"]["image"]["default"] == image_name("serving")
    docs = render_default()
    if docs is None:
        pytest.skip("helm is not installed (scripts/install-helm.sh)")
    assert operator_container(docs)["image"] == image_name("operator")
    assert default_deployment(docs)["spec"]["serving"]["image"] == image_name("serving")
