"""Which hosts and addresses may be fetched from (no network)."""

import ipaddress

import pytest

from loraplex.multimodal import InvalidMediaURL, MediaConfig, MediaNotAllowed
from loraplex.multimodal.addresses import check_http_url, refusal


@pytest.mark.parametrize(
    "address, reason",
    [
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("100.64.0.1", "not global"),  # carrier-grade NAT
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("::1", "loopback"),
        ("::", "unspecified"),
        ("fe80::1", "link-local"),
        ("fc00::1", "private"),
        ("fd12:3456::1", "private"),
        ("ff02::1", "multicast"),
        ("fec0::1", "site-local"),
        ("::ffff:127.0.0.1", "loopback (inside ::ffff:7f00:1)"),  # IPv4-mapped
        ("::ffff:10.0.0.1", "private (inside ::ffff:a00:1)"),
        ("2002:7f00:1::1", "loopback (inside 2002:7f00:1::1)"),  # 6to4 around 127.0.0.1
        ("64:ff9b::a9fe:a9fe", "link-local (inside 64:ff9b::a9fe:a9fe)"),  # NAT64 around 169.254.169.254
    ],
)
def test_non_public_addresses_are_refused(address, reason):
    assert refusal(ipaddress.ip_address(address), allow_private=False) == reason


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.216.34", "2606:4700:4700::1111", "64:ff9b::808:808"])
def test_public_addresses_pass(address):
    assert refusal(ipaddress.ip_address(address), allow_private=False) is None


@pytest.mark.parametrize("address", ["127.0.0.1", "10.0.0.1", "169.254.1.1", "::1", "fd00::1", "::ffff:192.168.0.1"])
def test_the_private_switch_admits_internal_ranges(address):
    assert refusal(ipaddress.ip_address(address), allow_private=True) is None


@pytest.mark.parametrize("address", ["0.0.0.0", "224.0.0.1", "::", "ff02::1", "::ffff:0.0.0.0"])
def test_unspecified_and_multicast_are_never_admitted(address):
    assert refusal(ipaddress.ip_address(address), allow_private=True) is not None


CONFIG = MediaConfig(allowed_media_domains=("Images.Example.COM.", "[::1]", "10.0.0.7", "bücher.example"))


def test_hosts_match_exactly_after_normalising():
    assert CONFIG.allowed_hosts == {"images.example.com", "::1", "10.0.0.7", "xn--bcher-kva.example"}
    target = check_http_url("HTTPS://IMAGES.example.com./a b/ü.png?x=1 2#frag", CONFIG)
    assert target == ("https", "images.example.com", 443, "/a%20b/%C3%BC.png?x=1%202")
    assert target.host_header == "images.example.com"
    assert check_http_url("http://[::1]:8080/i.png", CONFIG).host_header == "[::1]:8080"
    assert check_http_url("http://10.0.0.7/", CONFIG).port == 80
    assert check_http_url("http://bücher.example/x", CONFIG).host == "xn--bcher-kva.example"


@pytest.mark.parametrize(
    "url", ["https://cdn.images.example.com/x.png", "https://example.com/x.png", "https://images.example.com.evil.test/"]
)
def test_subdomains_and_lookalikes_are_not_allowed(url):
    with pytest.raises(MediaNotAllowed, match="is not in allowed_media_domains"):
        check_http_url(url, CONFIG)


@pytest.mark.parametrize(
    "url, message",
    [
        ("https://user:pw@images.example.com/x.png", "must not carry user names or passwords"),
        ("http://evil.test\\@images.example.com/", "must not carry user names or passwords"),
        ("https://images.example.com:99999/", "invalid host or port"),
        ("https:///x.png", "invalid host"),
        ("https://images_example.com/", "invalid host"),
        ("ftp://images.example.com/x.png", "only http and https"),
    ],
)
def test_malformed_urls_are_400(url, message):
    with pytest.raises(InvalidMediaURL, match=message) as caught:
        check_http_url(url, CONFIG)
    assert caught.value.status == 400
