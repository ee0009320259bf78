"""``dmtd serve``: the whole stack on this machine — Ray, registry, gateway, replica(s) — until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, MutableMapping
from typing import Any

from dmtd.serve.binding import HOST_ENV
from dmtd.serve.settings import ServeConfig, engine_default, serve_config, serve_default
from dmtd_contract.serve_config import DEFAULT_HTTP_PORT

READY_ENV = ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S")

# Ray's own bookkeeping that nothing of ours reads, off on the node ``dmtd serve`` starts (the stack exports
# its own metrics and traces; Serve's routing and autoscaling use neither): each took CPU from the cores the
# replica decodes on (under load at N = 16 on 2 cores, Ray's processes used 17% of a core with them, 13%
# without; scripts/profile_serve.py --cpu-only). ``DMTD_RAY_BOOKKEEPING=1`` keeps Ray's defaults.
LEAN_RAY_ENV = {
    "RAY_enable_metrics_collection": "0",  # Ray's Prometheus metrics, exported by every process every 10 s
    "RAY_enable_task_events": "0",  # per-task state events to the GCS (the dashboard's task table)
    "RAY_event_stats": "0",  # event-loop statistics in every Ray C++ component
    "REPORTER_UPDATE_INTERVAL_MS": "30000",  # the dashboard agent's psutil sweep of the node (default 5 s)
}
BOOKKEEPING_ENV = "DMTD_RAY_BOOKKEEPING"


class StartupError(RuntimeError):
    """The stack did not come up; the message names what did not."""


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=serve_default("grpc_host"), help="address the gRPC and HTTP servers bind")
    p.add_argument("--grpc-port", type=int, default=serve_default("grpc_port"))
    p.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                   help="the OpenAI API and dashboard, served by the gateway process itself (no Serve proxy)")
    p.add_argument("--registry", default=None, help="Redis URL of the variant registry (default: embedded)")
    p.add_argument("--model", default=None, help="base model (default: the embedded SmolLM2)")
    p.add_argument("--variant", default=None, help="variant to serve (default: the shipped variant, if any)")
    p.add_argument("--decoding-layers", type=int, default=None, help="with --variant none: DMTD split to run")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--routing", choices=("prefix", "pow2"), default="prefix",
                   help="with several replicas: prefix sends a request to the replica likeliest to hold its prompt's "
                   "prefix in its cache (load first); pow2: Serve's default, the less busy of two at random")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=None,
                   help="replicas' precision (default: the variant's recommendation, else auto: bfloat16 on a CPU "
                   "with AVX-512 or AVX2)")
    p.add_argument("--quant", choices=("none", "int8", "int4"), default=None,
                   help="replicas' weight-only quantisation (default: the variant's recommendation, else none)")
    p.add_argument("--max-num-seqs", type=int, default=engine_default("max_num_seqs"),
                   help="sequences a replica runs at once (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=engine_default("max_model_len"),
                   help="a sequence's positions at most, prompt + answer (default %(default)s)")
    p.add_argument("--kv-cache-tokens", type=int, default=engine_default("kv_cache_tokens"),
                   help="positions of a replica's KV pool, shared by its sequences in pages of 16 "
                   "(default %(default)s: what 16 sequences of 2,048 held)")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="size the KV pool by memory instead")
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16"], default=None,
                   help="the KV cache's element (default auto: float32 for a bfloat16 model; bfloat16 halves the "
                        "pool's bytes a position where the CPU kernels attend)")
    p.add_argument("--prefill-pace", type=float, default=None,
                   help="a prompt's prefill time a step while others decode, in decode steps (default 1; 0: whole "
                        "chunks between decode steps)")
    p.add_argument("--long-prefill-tokens", type=int, default=None,
                   help="prompts up to this many tokens are prefilled whole at the next step while others decode, "
                        "longer ones paced (default 2048; 0: every prompt paced)")
    p.add_argument("--max-queued", type=int, default=engine_default("max_queued"),
                   help="requests a replica holds waiting beyond --max-num-seqs before it refuses "
                   "(default %(default)s)")
    p.add_argument("--itl-slo-ms", type=float, default=engine_default("itl_slo_ms"),
                   help="per-token ITL SLO the τ controller aims at (default %(default)s)")
    p.add_argument("--drafts", choices=("adaptive", "fixed"), default=None,
                   help="how replicas draft for exact requests: 'adaptive' (default: the count that pays, none "
                   "where none does) or 'fixed' (up to τ − 1 a cycle)")
    p.add_argument("--no-context-drafts", action="store_true",
                   help="exact greedy requests draft with the tails only; by default a cycle may instead check the "
                   "tokens that followed an earlier occurrence of the context's last few tokens, or the variant's "
                   "phrase table's, where that pays")
    p.add_argument("--no-phrase-drafts", action="store_true",
                   help="as the default, without the variant's phrase table (prompt lookup and tails only)")
    p.add_argument("--block-push", default=None, metavar="auto|off|ADDRESS",
                   help="replicas push blocks straight to a TCP sink of the gateway (default auto: on loopback when "
                   "the gateway is); off: blocks travel as items of the Serve call (either way gathered by "
                   "--stream-interval-ms)")
    p.add_argument("--stream-interval-ms", type=float, default=None,
                   help="a replica gathers a request's blocks that are ready within this interval into one frame "
                   "(or streamed item), sent to the client as one message; the first and the last block go at once "
                   "(default 40; 0: every DMTD cycle on its own)")
    p.add_argument("--metrics-port", type=int, default=9464,
                   help="Prometheus port of the gateway; replicas take the next free ports")
    p.add_argument("--trace-exporter", choices=["memory", "console", "otlp", "none"], default=None,
                   help="where spans go (default: in memory, or OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set)")
    p.add_argument("--otlp-endpoint", default=None, help="OTLP/HTTP traces endpoint, e.g. http://HOST:4318/v1/traces")
    p.add_argument("--replica-type", default="cpu", help="price key of the replicas (docs/cost.md)")
    p.add_argument("--api-keys-file", default=None,
                   help="file of API keys, one a line (also: env DMTD_API_KEYS); then every call needs one")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: gRPC and HTTP serve TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--ready-timeout-s", type=float, default=60.0,
                   help="how long Serve's proxy may take to become ready (a loaded machine needs more than 5 s)")
    p.add_argument("--start-attempts", type=int, default=2, help="tries at starting Serve before giving up")
    p.add_argument("--demo", action="store_true",
                   help="start, stream one chat answer over gRPC, print tokens/s and block lengths, stop")


def ensure_registered(url: str, name: str, variant: str, model: str | None, decoding_layers: int | None) -> None:
    """Put the served variant in the registry (active, default) unless it is there already, and every other shipped
    variant of its trunk (active, no share of unnamed requests: its replicas serve each by name)."""
    from dmtd_contract.registry import RegistryClient, VariantNotFound, VariantSpec

    with RegistryClient(url) as reg:
        if variant != "none" and model in (None, "smollm2"):
            register_shipped_tails(reg, variant)
        try:
            reg.get(name)
            return
        except VariantNotFound:
            pass
        if variant != "none":
            from dmtd.variants.build import find_variant
            from dmtd.variants.manifest import read_manifest
            from dmtd.variants.paths import SHIPPED_VARIANTS

            path = find_variant(variant, [SHIPPED_VARIANTS])
            spec = VariantSpec.from_manifest(read_manifest(path), manifest_path=str(path), name=name)
        else:
            import json

            from dmtd.variants.loader import resolve_model_path

            layers = int(json.loads((resolve_model_path(model) / "config.json").read_text())["num_hidden_layers"])
            d = decoding_layers or 1
            tau_max = 8 if decoding_layers else 1
            spec = VariantSpec.model_validate({
                "name": name, "base_model": model or "smollm2", "num_thinking_layers": layers - d,
                "num_decoding_layers": d, "tau_max": tau_max, "default_tau": 1, "verifier": "base",
                "description": "base model with DMTD routing (untrained)" if decoding_layers else "plain base model",
            })
        reg.register(spec, status="active", traffic_weight=1.0, make_default=True)


def register_shipped_tails(reg: Any, variant: str) -> list[str]:
    """Register (active, weight 0) each shipped variant that shares ``variant``'s trunk — its base and layer split —
    and is not registered yet; the names registered."""
    from dmtd.variants.build import find_variant
    from dmtd.variants.manifest import MANIFEST_NAME, read_manifest
    from dmtd.variants.paths import SHIPPED_VARIANTS
    from dmtd_contract.registry import VariantNotFound, VariantSpec

    own = read_manifest(find_variant(variant, [SHIPPED_VARIANTS]))
    trunk = ("base_model", "base_fingerprint", "num_encoding_layers", "num_thinking_layers", "num_decoding_layers",
             "phase_anchor", "head_input")
    done = []
    for path in sorted(SHIPPED_VARIANTS.glob(f"*/{MANIFEST_NAME}")):
        m = read_manifest(path)
        if m.name == own.name or any(getattr(m, f) != getattr(own, f) for f in trunk):
            continue
        try:
            reg.get(m.name)
        except VariantNotFound:
            reg.register(VariantSpec.from_manifest(m, manifest_path=str(path)), status="active", traffic_weight=0.0)
            done.append(m.name)
    return done


def start_with_retry(start: Callable[[], None], attempts: int, cleanup: Callable[[], None],
                     what_failed: Callable[[], str], log: Callable[[str], None] = print) -> None:
    """``start()`` up to ``attempts`` times; then :class:`StartupError` naming what did not come up."""
    for attempt in range(1, max(1, attempts) + 1):
        try:
            start()
            return
        except Exception as e:
            what = what_failed()
            reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
            if attempt >= attempts:
                raise StartupError(f"{what} did not come up after {attempt} attempt(s): {type(e).__name__}: "
                                   f"{reason}") from e
            log(f"dmtd serve: {what} did not come up ({type(e).__name__}); retrying ({attempt}/{attempts})")
            cleanup()


def serve_not_up() -> str:
    """Which Serve parts are not healthy now (the proxy, a deployment), for the one-line start-up error."""
    try:
        from ray import serve

        st = serve.status()
        bad = [f"Serve proxy on node {n} ({getattr(p, 'value', p)})" for n, p in st.proxies.items()
               if str(getattr(p, "value", p)) != "HEALTHY"]
        bad += [f"deployment {d} ({getattr(ds.status, 'value', ds.status)})" for a in st.applications.values()
                for d, ds in a.deployments.items() if str(getattr(ds.status, "value", ds.status)) != "HEALTHY"]
    except Exception:
        return "the Serve controller or proxy"
    return ", ".join(bad) or "the Serve application"


def prepare_environment(ready_timeout_s: float, env: MutableMapping[str, str] | None = None) -> None:
    """Before ``ray.init`` (Ray's processes inherit it): Serve's proxy readiness and health waits sized for a
    loaded node (its default 5 s killed the proxy while a compiler kept both cores busy), Serve's per-replica
    gRPC server on loopback (``dmtd.serve.binding``), and Serve's control loop every 0.5 s instead of 0.1 s
    (at 0.1 s the controller alone took 3% of a core, on the cores the replica decodes on), and Ray's own
    bookkeeping off (``LEAN_RAY_ENV``) unless ``DMTD_RAY_BOOKKEEPING=1``. Values already set win."""
    target: MutableMapping[str, str] = os.environ if env is None else env
    target.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if target.get(BOOKKEEPING_ENV, "") in ("", "0"):
        for var, value in LEAN_RAY_ENV.items():
            target.setdefault(var, value)
    target.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
    for var in READY_ENV:
        target.setdefault(var, str(ready_timeout_s))
    target.setdefault(HOST_ENV, "127.0.0.1")


def stop_log_monitor() -> bool:
    """Stop the log monitor of the Ray node this process started: it tails every worker's log files to
    forward them to drivers, which ``log_to_driver=False`` never reads (2% of a core under load). The logs stay
    in Ray's session directory. False where there is none to stop (a node started elsewhere, bookkeeping kept)."""
    if os.environ.get(BOOKKEEPING_ENV, "") not in ("", "0"):
        return False
    try:
        from ray._private import ray_constants  # Ray has no public switch; ``ray start`` has one
        from ray._private import worker as ray_worker

        node = ray_worker._global_node
        if node is None or not node.head or not node.all_processes.get(ray_constants.PROCESS_TYPE_LOG_MONITOR):
            return False
        node.kill_log_monitor(check_alive=False)
        return True
    except Exception as e:  # noqa: BLE001 — an internal API: if it moved, the monitor keeps running
        print(f"dmtd serve: Ray's log monitor keeps running ({type(e).__name__}: {e})", file=sys.stderr)
        return False


def serve_args(args: argparse.Namespace, variant: str) -> ServeConfig:
    """``dmtd serve``'s flags as the Serve app's config (a flag left at None: the config's default, or its
    ``DMTD_*`` environment variable); a bad value raises ``ServeConfigError`` before anything starts."""
    name = variant if variant != "none" else ("base" if args.decoding_layers is None else
                                              f"base-d{args.decoding_layers}")
    metrics_port = getattr(args, "metrics_port", 9464)
    given = {
        "variants": [{"name": name, "variant": variant, "model": args.model, "decoding_layers": args.decoding_layers,
                      "replicas": args.replicas, "dtype": getattr(args, "dtype", None),
                      "quant": getattr(args, "quant", None)}],
        "grpc_host": args.host, "grpc_port": args.grpc_port, "http_port": getattr(args, "http_port", None),
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": getattr(args, "max_model_len", None),
        "kv_cache_tokens": getattr(args, "kv_cache_tokens", None),
        "kv_cache_gib": getattr(args, "kv_cache_gib", None), "max_queued": getattr(args, "max_queued", None),
        "kv_cache_dtype": getattr(args, "kv_cache_dtype", None),
        "prefill_pace": getattr(args, "prefill_pace", None),
        "long_prefill_tokens": getattr(args, "long_prefill_tokens", None),
        "routing": getattr(args, "routing", None), "itl_slo_ms": args.itl_slo_ms, "metrics_port": metrics_port,
        "replica_metrics_port": metrics_port + 1,
        "trace_exporter": getattr(args, "trace_exporter", None), "otlp_endpoint": getattr(args, "otlp_endpoint", None),
        "replica_type": getattr(args, "replica_type", None), "api_keys_file": getattr(args, "api_keys_file", None),
        "tls_cert_file": getattr(args, "tls_cert", None), "tls_key_file": getattr(args, "tls_key", None),
        "stream_interval_ms": getattr(args, "stream_interval_ms", None),
        "block_push": getattr(args, "block_push", None),
        "drafts": getattr(args, "drafts", None), "context_drafts": not getattr(args, "no_context_drafts", False),
        "phrase_drafts": not getattr(args, "no_phrase_drafts", False),
    }
    # a flag not given leaves its setting out: the environment's fallback, then the model's default
    return serve_config({k: v for k, v in given.items() if v is not None})


def start_stack(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    cfg = serve_args(args, variant)
    name = cfg.variants[0].name
    prepare_environment(float(getattr(args, "ready_timeout_s", 60.0)))
    from dmtd.registry import embedded_redis, registry_url

    url = registry_url(getattr(args, "registry", None)) or embedded_redis()
    import ray
    from ray import serve

    from dmtd.serve.app import build_app

    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
             configure_logging=False, _node_ip_address="127.0.0.1")  # Ray's own servers on loopback
    stop_log_monitor()
    cert = cfg.tls_cert_file
    ensure_registered(url, name, variant, args.model, args.decoding_layers)
    app = build_app(cfg.model_copy(update={"registry_url": url}))

    def start() -> None:
        # the gateway serves HTTP itself (http_port): no Serve proxy, whose hop cost a Ray call per streamed chunk
        serve.start(proxy_location="Disabled")
        serve.run(app, name="dmtd", route_prefix="/")

    def cleanup() -> None:
        try:
            serve.shutdown()
        except Exception as e:  # the retry starts Serve afresh either way
            print(f"dmtd serve: shutting the failed attempt down: {type(e).__name__}", file=sys.stderr)

    start_with_retry(start, int(getattr(args, "start_attempts", 2)), cleanup, serve_not_up,
                     lambda line: print(line, file=sys.stderr, flush=True))
    wait_warm(float(getattr(args, "ready_timeout_s", 60.0)))
    scheme = "https" if cert else "http"
    return {"variant": name, "grpc": f"{args.host}:{args.grpc_port}", "http": f"{scheme}://{args.host}:{args.http_port}",
            "registry": url, "metrics": metrics_urls(args.replicas)}


def wait_warm(ready_timeout_s: float) -> dict[str, Any]:
    """Wait until the gateway reports ready (dmtd.serve.readiness: a request through its own path and its OpenAI
    route reached a warm replica of every variant): the banner then means what ``/healthz`` means. Allowed
    ten times Serve's proxy readiness wait (a replica builds and warms its engine first); else ``StartupError``."""
    from ray import serve

    try:
        return dict(serve.get_deployment_handle("Gateway", app_name="dmtd").wait_ready.remote(
            10 * ready_timeout_s).result())
    except Exception as e:
        raise StartupError(f"the gateway's warm-up did not finish within {10 * ready_timeout_s:.0f} s "
                           f"({type(e).__name__}); {serve_not_up()}") from e


def metrics_urls(replicas: int) -> list[str]:
    """The gateway's Prometheus URL, then each replica's (asked through the handle until all answered)."""
    from ray import serve

    urls = [serve.get_deployment_handle("Gateway", app_name="dmtd").info.remote().result()["metrics_url"]]
    handle = serve.get_deployment_handle("DMTDReplica", app_name="dmtd")
    seen: set[str] = set()
    for _ in range(16 * max(1, replicas)):
        seen.add(handle.metrics_url.remote().result())
        if len(seen - {None}) >= replicas:
            break
    return [u for u in urls + sorted(seen) if u]


def stop_stack() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def demo(target: str) -> None:
    from dmtd.client import DMTDClient

    question = "Explain in three sentences why the sky is blue."
    print(f"\n> {question}\n")
    ks: list[int] = []
    taus: list[int] = []
    t_first = t_last = None
    with DMTDClient(target) as client:
        for block in client.generate(messages=[{"role": "user", "content": question}], max_new_tokens=96):
            now = time.perf_counter()
            t_first = t_first or now
            t_last = now
            ks.append(block.k)
            taus.append(block.tau)
            print(block.text, end="", flush=True)
    n = sum(ks)
    dt = (t_last or 0) - (t_first or 0)
    print(f"\n\n[{n} tokens in {len(ks)} blocks over gRPC, {(n - ks[0]) / dt if dt > 0 else 0:.1f} tok/s after "
          f"the first block, τ in force {sorted(set(taus))}]")
    hist = Counter(ks)
    print("block length histogram:")
    for k in sorted(hist):
        print(f"  k={k}: {'#' * hist[k]} {hist[k]}")


def serve_main(args: argparse.Namespace, variant: str) -> int:
    try:
        info = start_stack(args, variant)
    except StartupError as e:
        print(f"dmtd serve: {e}", file=sys.stderr)
        stop_stack()
        return 1
    try:
        if args.demo:
            demo(info["grpc"])
            return 0
        from dmtd.variants.build import variant_precision

        dtype, quant = variant_precision(variant, args.dtype, args.quant, "cpu")
        print(f"""
dmtd is serving variant {info['variant']!r}
  precision {dtype}{'' if quant == 'none' else ' ' + quant}   (--dtype/--quant: as given, else the variant's, else \
auto: bfloat16 where the kernels build; the exact profile is the base model's output bit for bit in either)
  gRPC   {info['grpc']}   (dmtd.v1.GenerateService, grpc.health.v1, reflection)
  HTTP   {info['http']}/v1   (OpenAI-compatible: /v1/completions, /v1/chat/completions, /v1/models)
  registry {info['registry']}   (dmtd variants list --registry '{info['registry']}')
  dashboard {info['http']}/dashboard   (live $/1M tokens, tokens/s, TTFT/ITL, τ and k)
  metrics  {'  '.join(info['metrics'])}   (Prometheus: gateway, then replicas)

Try:
  dmtd generate --server {info['grpc']} --chat "Hello!"
  curl {info['http']}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model": "{info['variant']}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
Ctrl-C stops it.""", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stop_stack()
