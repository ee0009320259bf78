"""Python client for the dmtd gateway (gRPC, ``dmtd.v1.GenerateService``).

    from dmtd.client import DMTDClient
    with DMTDClient("127.0.0.1:9000") as c:
        for block in c.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=64):
            print(block.text, end="", flush=True)
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import grpc

from dmtd.v1 import generate_pb2 as pb
from dmtd.v1 import generate_pb2_grpc as pb_grpc
from dmtd_contract.records import MAX_NEW_TOKENS_DEFAULT

PROFILES = {"": pb.CYCLE_PROFILE_UNSPECIFIED, "adaptive": pb.CYCLE_PROFILE_ADAPTIVE,
            "quality": pb.CYCLE_PROFILE_QUALITY, "balanced": pb.CYCLE_PROFILE_BALANCED, "speed": pb.CYCLE_PROFILE_SPEED,
            "exact": pb.CYCLE_PROFILE_EXACT}  # "": the variant's default profile
FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_CANCELLED: "cancelled", pb.FINISH_REASON_ERROR: "error"}


def build_request(prompt: str | None = None, messages: Sequence[dict[str, str]] | None = None, variant: str = "",
                  max_new_tokens: int = MAX_NEW_TOKENS_DEFAULT, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0,
                  seed: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  tau_min: int = 0, tau_max: int = 0, min_confidence: float | None = None,
                  profile: str = "", min_block_tokens: int = 0, flush_interval_ms: int = 0,
                  request_id: str = "", ignore_eos: bool = False, logprobs: int | None = None,
                  presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 0.0,
                  logit_bias: dict[int, float] | None = None, json_schema: str = "") -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=request_id, variant=variant, max_new_tokens=max_new_tokens, stop=list(stop),
        stop_token_ids=list(stop_token_ids), min_block_tokens=min_block_tokens,
        flush_interval_ms=flush_interval_ms, ignore_eos=ignore_eos,
        sampling=pb.SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p,
                                    presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                    repetition_penalty=repetition_penalty, logit_bias=logit_bias or {}),
        cycle=pb.CyclePreferences(tau_min=tau_min, tau_max=tau_max, profile=PROFILES[profile]),
        json_schema=json_schema,
    )
    if logprobs is not None:
        req.logprobs = logprobs
    if seed is not None:
        req.sampling.seed = seed
    if min_confidence is not None:
        req.cycle.min_confidence = min_confidence
    if messages is not None:
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    elif prompt is not None:
        req.prompt = prompt
    return req


class DMTDClient:
    """A blocking client; ``generate`` streams :class:`dmtd.v1.TokenBlock` messages as they arrive.

    ``api_key`` (default: env ``DMTD_API_KEY``) is sent as ``authorization: Bearer`` metadata; with
    ``root_certificates`` (PEM bytes of the CA, or of a self-signed server certificate) the channel is TLS."""

    def __init__(self, target: str, timeout_s: float | None = None, api_key: str | None = None,
                 root_certificates: bytes | None = None) -> None:
        if root_certificates is not None:
            self.channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates))
        else:
            self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GenerateServiceStub(self.channel)
        self.timeout_s = timeout_s
        key = api_key if api_key is not None else os.environ.get("DMTD_API_KEY")
        self.metadata = (("authorization", f"Bearer {key}"),) if key else None

    def generate(self, prompt: str | None = None, timeout_s: float | None = None,
                 **kwargs: Any) -> Iterator[pb.TokenBlock]:
        """Stream the blocks of one request. Breaking out of the loop cancels the request on the server."""
        call = self.stub.Generate(build_request(prompt=prompt, **kwargs), timeout=timeout_s or self.timeout_s,
                                  metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def list_variants(self) -> pb.ListVariantsResponse:
        return self.stub.ListVariants(pb.ListVariantsRequest(), timeout=self.timeout_s, metadata=self.metadata)

    def get_variant(self, name: str) -> pb.VariantInfo:
        return self.stub.GetVariant(pb.GetVariantRequest(name=name), timeout=self.timeout_s, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> DMTDClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncDMTDClient:
    """The asyncio client (``grpc.aio``): ``generate`` is an async iterator of :class:`dmtd.v1.TokenBlock`.
    Many streams share one event loop and no thread per channel (the blocking client's channels each spin a
    polling thread while a stream is open).

        async with AsyncDMTDClient("127.0.0.1:9000") as c:
            async for block in c.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=64):
                print(block.text, end="", flush=True)
    """

    def __init__(self, target: str, timeout_s: float | None = None, api_key: str | None = None,
                 root_certificates: bytes | None = None,
                 options: Sequence[tuple[str, Any]] | None = None) -> None:
        """``options``: gRPC channel arguments, e.g. a ``grpc.service_config`` that balances over several gateways
        (``ipv4:A:9000,B:9000``, round_robin) and retries a call refused by a draining one."""
        if root_certificates is not None:
            self.channel = grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(root_certificates),
                                                   options=options)
        else:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        self.stub = pb_grpc.GenerateServiceStub(self.channel)
        self.timeout_s = timeout_s
        key = api_key if api_key is not None else os.environ.get("DMTD_API_KEY")
        self.metadata = (("authorization", f"Bearer {key}"),) if key else None

    async def generate(self, prompt: str | None = None, timeout_s: float | None = None,
                       **kwargs: Any) -> AsyncIterator[pb.TokenBlock]:
        """Stream the blocks of one request. Closing the iterator cancels the request on the server at once
        (``async with contextlib.aclosing(c.generate(...)) as blocks``); a loop left early without closing it
        cancels when the iterator is collected."""
        call = self.stub.Generate(build_request(prompt=prompt, **kwargs), timeout=timeout_s or self.timeout_s,
                                  metadata=self.metadata)
        try:
            async for block in call:
                yield block
        finally:
            call.cancel()

    async def list_variants(self) -> pb.ListVariantsResponse:
        return await self.stub.ListVariants(pb.ListVariantsRequest(), timeout=self.timeout_s, metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncDMTDClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


@dataclass(slots=True)
class RemoteRun:
    """One request streamed from a server, as ``dmtd generate --server`` reports it."""

    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tokens_per_s: float = 0.0
    finish: str | None = None
    tau: int = 0
    taus: set[int] = field(default_factory=set)
    prompt_tokens: int = 0
    variant: str = ""
    num_drafted: int = 0
    num_accepted: int = 0
    verifier: str = ""


def stream_run(client: DMTDClient, echo: bool, **kwargs: Any) -> RemoteRun:
    """Stream one request; decode tokens/s counts from the first block (as the local command from the first
    token)."""
    import time

    run = RemoteRun()
    t_first = t_last = 0.0
    first_k = 0
    for b in client.generate(**kwargs):
        now = time.perf_counter()
        if not run.blocks:
            t_first, first_k = now, len(b.token_ids)
        t_last = now
        run.tokens.extend(b.token_ids)
        if b.token_ids:
            run.blocks.append(len(b.token_ids))
        run.text.append(b.text)
        run.tau, run.variant = b.tau, b.variant
        run.taus.add(b.tau)
        run.num_drafted += b.num_drafted
        run.num_accepted += b.num_accepted
        if echo:
            print(b.text, end="", flush=True)
        if b.finish_reason:
            run.finish = FINISH_NAMES.get(b.finish_reason, "stop")
            run.prompt_tokens, run.verifier = b.usage.prompt_tokens, b.verifier
    dt = t_last - t_first
    run.tokens_per_s = (len(run.tokens) - first_k) / dt if dt > 0 else 0.0
    return run


def generate_to_console(target: str, *, prompt: str | None, chat: str | None, variant: str | None,
                        as_json: bool, compare_tau1: bool = False, **kwargs: Any) -> dict[str, Any]:
    """What ``dmtd generate --server`` does: stream text, then report tokens/s and the mean block length (and,
    for the exact profile, the drafts accepted and the verifier).

    Returns the same record the local command prints with ``--json``, except that ``prompt_token_ids`` is
    None: the server tokenises the prompt and sends back only ``prompt_tokens``, its length. With
    ``compare_tau1`` the same request runs again at τ = 1 (gate 0; for the exact profile: the verifier alone)
    and the record gains its tokens/s, the speedup and, greedy and exact, whether the tokens are the same.
    """
    import sys

    messages = [{"role": "user", "content": chat}] if chat is not None else None
    out = sys.stderr if as_json else sys.stdout
    request = {"prompt": prompt, "messages": messages, "variant": variant or "", **kwargs}
    with DMTDClient(target) as client:
        run = stream_run(client, not as_json, **request)
        ref = None
        if compare_tau1:
            ref = stream_run(client, False, **{**request, "tau_min": 1, "tau_max": 1, "min_confidence": 0.0})
    if not as_json:
        print()
    mean_block = sum(run.blocks) / len(run.blocks) if run.blocks else 0.0
    checked = ""
    if run.verifier:  # the server ran verified cycles
        rate = run.num_accepted / run.num_drafted if run.num_drafted else 0.0
        checked = (f", exact: {run.num_accepted}/{run.num_drafted} drafts accepted ({rate:.0%}), "
                   f"verifier {run.verifier}")
    print(f"[{len(run.tokens)} tokens, {run.tokens_per_s:.1f} tok/s decode, mean block {mean_block:.2f}, τ={run.tau}"
          f"{checked}, finish={run.finish}]", file=out)
    record: dict[str, Any] = {
        "prompt_token_ids": None, "prompt_tokens": run.prompt_tokens, "token_ids": run.tokens,
        "text": "".join(run.text), "tokens_per_s": run.tokens_per_s, "mean_block_len": mean_block,
        "block_lens": run.blocks, "tau": run.tau, "finish_reason": run.finish, "variant": run.variant,
        "server": target, "profile": "exact" if run.verifier else "dmtd",
    }
    if run.verifier:
        record.update(verifier=run.verifier, num_drafted=run.num_drafted, num_accepted=run.num_accepted)
    if ref is not None:
        label, greedy = f"τ={run.tau}", float(kwargs.get("temperature") or 0.0) < 1e-2
        if ref.taus != {1}:
            label += f"; the server ran τ in {sorted(ref.taus)}, not 1: its τ range excludes it"
        compare_with_tau1(record, run.tokens, run.tokens_per_s, ref.tokens, ref.tokens_per_s, label,
                          run.verifier if greedy and ref.taus == {1} else None, out)
    return record


def compare_with_tau1(record: dict[str, Any], tokens: list[int], tok_s: float, ref_tokens: list[int],
                      ref_tok_s: float, label: str, verifier: str | None, out: TextIO,
                      base_model: bool = False) -> None:
    """Report a request against its τ = 1 twin (``--compare-tau1``): the speedup and, given the ``verifier`` of
    a greedy exact request, whether the tokens are the same; into ``record`` and one line on ``out``.
    ``base_model``: the twin ran on the base model's own engine (``--variant none``), not the variant's."""
    speedup = tok_s / ref_tok_s if ref_tok_s > 0 else 0.0
    match = ""
    twin = "the base model's (--variant none)" if base_model else "τ = 1's"
    if verifier:
        same = ref_tokens == tokens
        match = (f"; tokens identical to {twin}" if same else f"; TOKENS DIFFER from {twin}") + f" ({verifier} model)"
        record["tokens_match_tau1"] = same
    where = "the base model" if base_model else "the same request"
    print(f"[τ=1 on {where}: {ref_tok_s:.1f} tok/s → speedup {speedup:.2f}× at {label}{match}]", file=out)
    record.update(tau1_tokens_per_s=ref_tok_s, speedup_vs_tau1=speedup, tau1_token_ids=ref_tokens)
