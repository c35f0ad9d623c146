"""A worker's registration in etcd: put under a lease, kept alive, revoked on the way out.

A worker that stops keeping its lease alive (killed, frozen, cut off) leaves
routing when the lease expires; one that stops on purpose revokes it first.
etcd being out of reach does not stop the worker serving: it keeps trying, and
registers again under a new lease if the old one expired meanwhile.

With the deployment's worker secret the registration is signed (routers with the
secret use only signed entries); etcd's own credentials come from ``[discovery]``.
"""

from __future__ import annotations

import logging

import trio

from pdtrio.config import DiscoveryConfig
from pdtrio.discovery.etcd import EtcdAuthFailed, EtcdClient, EtcdError, EtcdLeaseLost, etcd_client
from pdtrio.protocol.link.registration import (
    AnyRegistration,
    encode_registration,
    registration_key,
    sign_registration,
)

log = logging.getLogger("pdtrio.worker.registration")

# the most a deregistration may take when the worker stops
_DEREGISTER_TIMEOUT_S = 2.0


async def keep_registered(
    config: DiscoveryConfig,
    registration: AnyRegistration,
    stop: trio.Event,
    *,
    signing_key: bytes | None = None,
    logger: logging.Logger = log,
) -> None:
    """Stay registered until ``stop`` is set (or cancelled), then deregister.

    ``signing_key`` (``pdtrio.security.derive_key(secret, "registration")``): the
    registration is signed with it; None: unsigned (a deployment without a secret).
    ``registration``: a worker's, or an engine's (``pdtrio register``, logging as
    ``logger``).
    """
    log = logger
    key = registration_key(config.prefix, registration.instance_id)
    if signing_key is not None:
        registration = sign_registration(registration, key, signing_key)
    value = encode_registration(registration)
    ttl_s = config.lease_ttl_s
    async with etcd_client(config) as client:
        lease: int | None = None
        out_of_reach = False
        try:
            while not stop.is_set():
                try:
                    if lease is None:
                        lease = await client.grant_lease(ttl_s)
                        await client.put(key, value, lease=lease)
                        log.info("registered in etcd as %s (lease ttl %ds)", key, ttl_s)
                    else:
                        await client.keep_alive_once(lease)
                    if out_of_reach:
                        log.info("etcd is reachable again")
                        out_of_reach = False
                    wait_s = ttl_s / 3
                except EtcdLeaseLost:
                    log.warning("the etcd lease expired (etcd was out of reach): registering again")
                    lease = None
                    wait_s = 0.0
                except EtcdAuthFailed as exc:
                    if not out_of_reach:
                        log.error("etcd refuses the credentials given, still serving: %s", exc)
                        out_of_reach = True
                    wait_s = min(1.0, ttl_s / 3)
                except EtcdError as exc:
                    if not out_of_reach:
                        log.warning("etcd is out of reach, still serving: %s", exc)
                        out_of_reach = True
                    wait_s = min(1.0, ttl_s / 3)
                with trio.move_on_after(wait_s):
                    await stop.wait()
        finally:
            if lease is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(_DEREGISTER_TIMEOUT_S):
                    await _deregister(client, key, lease, ttl_s, log)


async def _deregister(
    client: EtcdClient, key: str, lease: int, ttl_s: int, log: logging.Logger
) -> None:
    try:
        await client.revoke_lease(lease)  # deletes the key with it
    except EtcdError as exc:
        log.warning("could not deregister %s (its lease ends in %ds anyway): %s", key, ttl_s, exc)
    else:
        log.info("deregistered %s from etcd", key)
