"""Python client for the dmtd gateway (gRPC, ``dmtd.v1.GenerateService``).

    from dmtd.client import DMTDClient
    with DMTDClient("127.0.0.1:9000") as c:
        for block in c.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=64):
            print(block.text, end="", flush=True)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from dmtd.v1 import generate_pb2 as pb
from dmtd.v1 import generate_pb2_grpc as pb_grpc

PROFILES = {"adaptive": pb.CYCLE_PROFILE_UNSPECIFIED, "quality": pb.CYCLE_PROFILE_QUALITY,
            "balanced": pb.CYCLE_PROFILE_BALANCED, "speed": pb.CYCLE_PROFILE_SPEED, "exact": pb.CYCLE_PROFILE_EXACT}
FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_CANCELLED: "cancelled", pb.FINISH_REASON_ERROR: "error"}


def build_request(prompt: str | None = None, messages: Sequence[dict[str, str]] | None = None, variant: str = "",
                  max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  tau_min: int = 0, tau_max: int = 0, min_confidence: float | None = None,
                  profile: str = "adaptive", min_block_tokens: int = 0, flush_interval_ms: int = 0,
                  request_id: str = "", ignore_eos: bool = False) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=request_id, variant=variant, max_new_tokens=max_new_tokens, stop=list(stop),
        stop_token_ids=list(stop_token_ids), min_block_tokens=min_block_tokens,
        flush_interval_ms=flush_interval_ms, ignore_eos=ignore_eos,
        sampling=pb.SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p),
        cycle=pb.CyclePreferences(tau_min=tau_min, tau_max=tau_max, profile=PROFILES[profile]),
    )
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


def generate_to_console(target: str, *, prompt: str | None, chat: str | None, variant: str | None,
                        as_json: bool, **kwargs: Any) -> dict[str, Any]:
    """What ``dmtd generate --server`` does: stream text, then report tokens/s and the mean block length.

    Returns the same record the local command prints with ``--json`` (decode tokens/s counts from the
    first block, as the local command counts from the first token), except that ``prompt_token_ids`` is
    None: the server tokenises the prompt and sends back only ``prompt_tokens``, its length.
    """
    import sys
    import time

    messages = [{"role": "user", "content": chat}] if chat is not None else None
    tokens: list[int] = []
    blocks: list[int] = []
    text: list[str] = []
    t_first = t_last = 0.0
    first_k = 0
    finish = None
    tau = 0
    prompt_tokens = 0
    served_by = ""
    with DMTDClient(target) as client:
        for b in client.generate(prompt=prompt, messages=messages, variant=variant or "", **kwargs):
            now = time.perf_counter()
            if not blocks:
                t_first, first_k = now, len(b.token_ids)
            t_last = now
            tokens.extend(b.token_ids)
            if b.token_ids:
                blocks.append(len(b.token_ids))
            text.append(b.text)
            tau, served_by = b.tau, b.variant
            if not as_json:
                print(b.text, end="", flush=True)
            if b.finish_reason:
                finish = FINISH_NAMES.get(b.finish_reason, "stop")
                prompt_tokens = b.usage.prompt_tokens
    dt = t_last - t_first
    tok_s = (len(tokens) - first_k) / dt if dt > 0 else 0.0
    mean_block = sum(blocks) / len(blocks) if blocks else 0.0
    if not as_json:
        print()
    print(f"[{len(tokens)} tokens, {tok_s:.1f} tok/s decode, mean block {mean_block:.2f}, τ={tau}, finish={finish}]",
          file=sys.stderr if as_json else sys.stdout)
    # The server tokenises the prompt and reports only its length: the ids are not known here (None).
    return {"prompt_token_ids": None, "prompt_tokens": prompt_tokens, "token_ids": tokens, "text": "".join(text),
            "tokens_per_s": tok_s, "mean_block_len": mean_block, "block_lens": blocks, "tau": tau,
            "finish_reason": finish, "variant": served_by, "server": target}
