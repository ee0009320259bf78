# A stand-in for the chart's default registry image (redis:7.4-alpine) where no image registry is reachable:
# Debian's redis-server on the local base, started the way the official image starts it. tests/cluster runs the
# chart's Redis StatefulSet with it (helm --set redis.image.repository=localhost/dmtd/redis,redis.image.tag=7-bookworm).
#   IMAGES=redis bash scripts/build-images.sh
ARG BASE_IMAGE=localhost/dmtd/debian-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir /data && chown 999:999 /data \
 && printf '%s\n' '#!/bin/sh' \
      '# as the official image: a bare `redis-server ...` (no config file) listens unprotected, the pod network' \
      '# being its only reach' \
      'if [ "$1" = redis-server ]; then shift; exec redis-server "$@" --protected-mode no; fi' \
      'exec "$@"' > /usr/local/bin/docker-entrypoint.sh \
 && chmod 755 /usr/local/bin/docker-entrypoint.sh
VOLUME /data
WORKDIR /data
EXPOSE 6379
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
