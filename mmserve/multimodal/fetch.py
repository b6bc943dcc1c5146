"""Downloads of user media over http(s) with an SSRF guard: every hop's host is resolved and each address checked
(public unicast only, unless allow_private_urls), connections go to checked addresses only, redirects are followed
by hand, and the byte cap and the wall-clock budget hold for the whole fetch. One policy (_Download) serves the sync
and the async clients."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import time
from typing import Any

import httpx

from mmserve.multimodal.media_limits import MediaConfig, MediaError, check_media_bytes, media_error

MAX_REDIRECTS = 5


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def is_public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """True for globally routable unicast addresses, looking inside IPv4-mapped/6to4/Teredo/NAT64 forms."""
    if ip.version == 6 and ip in _NAT64:
        return is_public_address(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    embedded = ip.version == 6 and (
        ip.ipv4_mapped or ip.sixtofour or (ip.teredo or (None, None))[1]
    )
    if embedded and not is_public_address(embedded):
        return False
    return ip.is_global and not (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


class _Download:
    """Policy of one URL download, shared by the sync and async clients. Each hop's host is resolved and
    every address checked; connections go to checked addresses only (Host header and TLS SNI keep the
    name), so a second DNS answer cannot slip in between."""

    def __init__(self, url: str, config: MediaConfig, field: str):
        self.config, self.field = config, field
        self.url = self._parse(url)
        self.redirects, self.body = 0, bytearray()
        self.addresses: list[str] = []  # checked addresses of self.url's host not tried yet
        self.deadline = time.monotonic() + config.fetch_timeout_s

    def _parse(self, url: str) -> httpx.URL:
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError, TypeError) as exc:
            raise media_error(self.field, f"invalid URL {str(url)!r:.120}") from exc
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise media_error(
                self.field, f"only http(s) URLs with a host can be fetched, got {str(url)!r:.120}"
            )
        return parsed

    def next_request(self) -> dict[str, Any]:
        """Keyword arguments for client.stream aimed at the next checked address (may block in getaddrinfo)."""
        host = self.url.raw_host.decode("ascii")
        if not self.addresses:
            try:
                infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            except (OSError, UnicodeError) as exc:
                raise media_error(self.field, f"cannot resolve host {host!r}") from exc
            addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
            refused = [address for address in addresses if not is_public_address(address)]
            if refused and not self.config.allow_private_urls:
                raise media_error(
                    self.field,
                    f"URL host {host!r} resolves to {refused[0]}, a private/loopback/"
                    "link-local/reserved address; set allow_private_urls=True to allow it",
                )
            self.addresses = list(dict.fromkeys(str(address) for address in addresses))
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise self.fail(TimeoutError())
        headers = {"Host": self.url.netloc.decode("ascii"), "Accept-Encoding": "identity"}
        return {
            "method": "GET",
            "url": self.url.copy_with(host=self.addresses.pop(0)),
            "headers": headers,
            "extensions": {"sni_hostname": host},
            "timeout": remaining,
        }

    def on_connect_error(self, exc: httpx.ConnectError) -> None:
        """Go on with the host's next checked address; raise when none is left."""
        if not self.addresses:
            raise self.fail(exc) from exc

    def on_response(self, response: httpx.Response) -> bool:
        """True when the response redirects (self.url moved on: request again); raises on errors."""
        if response.has_redirect_location:
            self.redirects += 1
            if self.redirects > MAX_REDIRECTS:
                raise media_error(self.field, f"too many redirects (more than {MAX_REDIRECTS})")
            self.url = self._parse(str(self.url.join(response.headers["Location"])))
            self.addresses = []
            return True
        if not response.is_success:
            raise media_error(
                self.field, f"GET {str(self.url):.120} returned HTTP {response.status_code}"
            )
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit():
            check_media_bytes(int(declared), self.config, self.field)
        return False

    def feed(self, chunk: bytes) -> None:
        self.body += chunk
        check_media_bytes(len(self.body), self.config, self.field)
        if time.monotonic() > self.deadline:  # per-read timeouts alone let a slow drip run forever
            raise self.fail(TimeoutError())

    def fail(self, exc: BaseException) -> MediaError:
        timed_out = isinstance(exc, (httpx.TimeoutException, TimeoutError))
        reason = (
            f"timed out after {self.config.fetch_timeout_s}s" if timed_out else f"failed: {exc}"
        )
        return media_error(self.field, f"fetching {str(self.url):.120} {reason}")


@functools.cache
def _client_options() -> dict[str, Any]:
    # trust_env=False: a proxy taken from the environment would resolve hosts itself, past the address check
    return {"follow_redirects": False, "trust_env": False, "verify": httpx.create_ssl_context()}


def download(url: str, config: MediaConfig, field: str) -> bytes:
    fetch = _Download(url, config, field)
    try:
        with httpx.Client(**_client_options()) as client:
            while True:
                try:
                    with client.stream(**fetch.next_request()) as response:
                        if fetch.on_response(response):
                            continue
                        for chunk in response.iter_bytes():
                            fetch.feed(chunk)
                        return bytes(fetch.body)
                except httpx.ConnectError as exc:
                    fetch.on_connect_error(exc)
    except (httpx.HTTPError, TimeoutError) as exc:
        raise fetch.fail(exc) from exc


async def adownload(url: str, config: MediaConfig, field: str) -> bytes:
    fetch = _Download(url, config, field)
    try:
        async with (
            asyncio.timeout(config.fetch_timeout_s),
            httpx.AsyncClient(**_client_options()) as client,
        ):
            while True:
                request = await asyncio.to_thread(fetch.next_request)  # getaddrinfo blocks
                try:
                    async with client.stream(**request) as response:
                        if fetch.on_response(response):
                            continue
                        async for chunk in response.aiter_bytes():
                            fetch.feed(chunk)
                        return bytes(fetch.body)
                except httpx.ConnectError as exc:
                    fetch.on_connect_error(exc)
    except (httpx.HTTPError, TimeoutError) as exc:
        raise fetch.fail(exc) from exc
