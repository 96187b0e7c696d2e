"""TLS and API key settings: `TlsSettings` from the environment (plaintext, mutual TLS,
every inconsistent combination refused naming the variable, a server name override checked
against a real gRPC server) and the gateway's API key from a flag, the environment or a
file (kept out of `repr`, bad values refused naming the setting)."""

from __future__ import annotations

import asyncio

import pytest
from cryptography import x509

from common.config import load_config
from common.grpc_server import ServiceHost
from common.tls import TlsSettings
from services.gateway.config import GatewayConfig
from tests.throwaway_pki import Pki, check_health, make_pki

API_KEY = "tandem-test-key-4f9c"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# --- TlsSettings ---------------------------------------------------------------------------


def test_nothing_set_means_plaintext():
    tls = TlsSettings.from_env({})
    assert not tls.enabled and not tls.client_auth
    assert TlsSettings.from_env({"TANDEM_TLS_CLIENT_AUTH": "false"}) == tls


def test_a_full_mutual_tls_environment_is_accepted(pki):
    tls = TlsSettings.from_env(pki.env())
    assert tls.enabled and tls.can_serve and tls.client_auth
    assert tls.server_credentials() is not None and tls.channel_credentials() is not None
    client_only = TlsSettings.from_env({"TANDEM_TLS_CA": str(pki.ca.path)})
    assert client_only.enabled and not client_only.can_serve
    with pytest.raises(ValueError, match="a server needs its own certificate"):
        client_only.server_credentials()


@pytest.mark.parametrize(
    "env, message",
    [
        ({"TANDEM_TLS_CERT": "{cert}"}, "TANDEM_TLS_CERT is set but TANDEM_TLS_KEY is not"),
        ({"TANDEM_TLS_KEY": "{key}"}, "TANDEM_TLS_KEY is set but TANDEM_TLS_CERT is not"),
        (
            {"TANDEM_TLS_CERT": "{cert}", "TANDEM_TLS_KEY": "{key}", "TANDEM_TLS_CLIENT_AUTH": "1"},
            "TANDEM_TLS_CLIENT_AUTH needs TANDEM_TLS_CA",
        ),
        (
            {"TANDEM_TLS_CA": "{ca}", "TANDEM_TLS_CLIENT_AUTH": "true"},
            "TANDEM_TLS_CLIENT_AUTH needs TANDEM_TLS_CERT and TANDEM_TLS_KEY",
        ),
        ({"TANDEM_TLS_CA": "{ca}", "TANDEM_TLS_CLIENT_AUTH": "maybe"}, "must be true or false"),
        ({"TANDEM_TLS_CA": "/nonexistent/ca.pem"}, "TANDEM_TLS_CA: cannot read"),
        (
            {"TANDEM_TLS_CERT": "{cert}", "TANDEM_TLS_KEY": "/nonexistent/key.pem"},
            "TANDEM_TLS_KEY: cannot read",
        ),
        ({"TANDEM_TLS_CA": "{garbage}"}, "TANDEM_TLS_CA: .* is not a PEM file"),
        (
            {"TANDEM_TLS_CERT": "{cert}", "TANDEM_TLS_KEY": "{other_key}"},
            "are not a PEM certificate and its unencrypted private key",
        ),
        ({"TANDEM_TLS_CA": "{key}"}, "TANDEM_TLS_CA: .* holds no usable PEM CA certificate"),
        ({"TANDEM_TLS_SERVER_NAME": "localhost"}, "TANDEM_TLS_SERVER_NAME is set but TLS is off"),
    ],
)
def test_inconsistent_settings_raise_naming_the_variable(pki, tmp_path, env, message):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    paths = {
        "cert": pki.service[0],
        "key": pki.service[1],
        "other_key": pki.rogue[1],
        "ca": str(pki.ca.path),
        "garbage": str(garbage),
    }
    env = {name: value.format(**paths) for name, value in env.items()}
    with pytest.raises(ValueError, match=message):
        TlsSettings.from_env(env)


def test_server_name_override_checks_the_certificate_against_that_name(pki, tmp_path):
    """A certificate issued only for `tandem.internal` fails against 127.0.0.1 unless the
    client checks it against TANDEM_TLS_SERVER_NAME."""
    named = pki.ca.issue(tmp_path, "named", sans=[x509.DNSName("tandem.internal")])
    ca = str(pki.ca.path)
    server = TlsSettings(cert_file=named[0], key_file=named[1], ca_file=ca)

    async def scenario() -> tuple[str, str]:
        host = ServiceHost(["tandem.test.Nothing"], tls=server)
        port = host.bind("127.0.0.1", 0)
        await host.start()
        await host.set_serving(True)
        try:
            address = f"127.0.0.1:{port}"
            plain_name = await asyncio.to_thread(check_health, address, TlsSettings(ca_file=ca))
            overridden = TlsSettings(ca_file=ca, server_name="tandem.internal")
            return plain_name, await asyncio.to_thread(check_health, address, overridden)
        finally:
            await host.stop(0)

    assert asyncio.run(scenario()) == ("UNAVAILABLE", "SERVING")


# --- the gateway's API key setting -----------------------------------------------------------


def test_api_key_comes_from_flag_env_or_file_and_stays_out_of_repr(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(f"  {API_KEY}\n")
    from_env = load_config(GatewayConfig, ["--model", "m"], env={"TANDEM_API_KEY": API_KEY})
    from_flag = load_config(GatewayConfig, ["--model", "m", "--api-key", API_KEY], env={})
    from_file = load_config(
        GatewayConfig, ["--model", "m"], env={"TANDEM_API_KEY_FILE": str(key_file)}
    )
    for config in (from_env, from_flag, from_file):
        assert config.resolved_api_key == API_KEY
        assert API_KEY not in repr(config)
    assert load_config(GatewayConfig, ["--model", "m"], env={}).resolved_api_key == ""


@pytest.mark.parametrize(
    "argv, file_text, message",
    [
        (["--api-key", "k", "--api-key-file", "{file}"], "k", "api_key or api_key_file, not both"),
        (["--api-key-file", "/nonexistent/key"], None, "api_key_file: cannot read"),
        (["--api-key-file", "{file}"], "  \n", "api_key_file: .* is empty"),
        (["--api-key", "two words"], None, "api_key must be printable ASCII without spaces"),
        (["--api-key", "clé"], None, "api_key must be printable ASCII"),
        (["--api-key", "k" * 4097], None, "api_key must be at most 4096 characters"),
    ],
)
def test_bad_api_key_settings_raise_naming_the_setting(tmp_path, argv, file_text, message):
    key_file = tmp_path / "key"
    if file_text is not None:
        key_file.write_text(file_text)
    argv = ["--model", "m", *(a.format(file=key_file) for a in argv)]
    with pytest.raises(ValueError, match=message):
        load_config(GatewayConfig, argv, env={})
