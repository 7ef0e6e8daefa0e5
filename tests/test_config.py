"""Settings: YAML validation, -o options, precedence, credentials by reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardfs.cli.config import (
    ConfigError,
    load_file,
    merge,
    parse_mount_options,
    resolve_credentials,
    validate,
)


def test_load_validates_and_converts(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("sources: http://x/a-{0..3}.tar\ncache_size: 2G\ntimeout: 5\n"
                    "allow_other: yes\nmax_fetches: 3\n")
    settings = load_file(path)
    assert settings == {"sources": ["http://x/a-{0..3}.tar"], "cache_size": 2 << 30,
                        "timeout": 5.0, "allow_other": True, "max_fetches": 3}


@pytest.mark.parametrize(("text", "message"), [
    ("- a\n- b\n", "expected a mapping"),
    ("cache_size: [1]\n", "cache_size: bad value"),
    ("max_fetches: 1.5\n", "max_fetches: bad value 1.5"),
    ("max_fetches: true\n", "max_fetches: bad value True"),
    ("metrics_listen: localhost\n", "expected HOST:PORT"),
    ("sources: []\n", "sources: bad value"),
    ("timeout: soon\n", "timeout: bad value 'soon'"),
    ("key: [unclosed\n", "not valid YAML"),
])
def test_load_errors(tmp_path: Path, text: str, message: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_file(path)


def test_missing_file_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_file(tmp_path / "none.yaml")


def test_mount_options_ignore_generic_ones_and_map_aliases():
    settings, config = parse_mount_options(
        "ro,_netdev,nofail,dev,suid,noatime,x-systemd.automount,cache_dir=/c,cache_size=1M,"
        "allow_other,no_warm,config=/etc/shardfs/a.yaml,max-fetches=2")
    assert config == "/etc/shardfs/a.yaml"
    assert settings == {"cache_dir": "/c", "cache_size": 1 << 20, "allow_other": True,
                        "warm_while_indexing": False, "max_fetches": 2}
    with pytest.raises(ConfigError, match="unknown option 'cache_sise'"):
        parse_mount_options("cache_sise=1G")


def test_precedence_defaults_file_options_flags():
    file_layer = validate({"timeout": 3, "deadline": 30}, "file")
    option_layer = validate({"deadline": 40}, "-o")
    flag_layer = validate({"deadline": 50}, "flags")
    merged = merge(file_layer, option_layer, flag_layer)
    assert merged["timeout"] == 3.0 and merged["deadline"] == 50.0
    assert merged["max_fetches"] == 8  # the default where nobody said anything


def test_credentials_by_reference_only(tmp_path: Path, monkeypatch):
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t\n")
    monkeypatch.setenv("MY_KEY_ID", "AKIDEXAMPLE")
    refs = validate({"credentials": {"access_key_id": {"env": "MY_KEY_ID"},
                                     "secret_access_key": {"file": str(secret)}}}, "file")
    assert resolve_credentials(refs["credentials"]) == {"access_key_id": "AKIDEXAMPLE",
                                                        "secret_access_key": "s3cr3t"}
    with pytest.raises(ConfigError, match="never written inline") as info:
        validate({"credentials": {"secret_access_key": "s3cr3t"}}, "file")
    assert "s3cr3t" not in str(info.value)
    monkeypatch.delenv("MY_KEY_ID")
    with pytest.raises(ConfigError, match="MY_KEY_ID is not set"):
        resolve_credentials(refs["credentials"])


@pytest.mark.parametrize(("flag", "key", "field", "default"), [
    ("--split-fetches", "split_fetches", "split_fetches", False),
    ("--small-windows", "small_windows", "cold_start_small_windows", True)])
def test_policy_switches_from_flag_option_and_file(tmp_path: Path, flag: str, key: str,
                                                   field: str, default: bool):
    """`--split-fetches` / `--small-windows on|off`, `-o KEY=...` and `KEY:` in the config
    all reach the read policy; the defaults: split fetches off, small windows on."""
    import argparse

    from shardfs.cli.main import _mount_config, add_mount_arguments, mount_settings

    other = "off" if default else "on"
    config = tmp_path / "c.yaml"
    config.write_text(f"{key}: {str(not default).lower()}\n")
    cases = {(): default, (flag, other): not default, ("-o", f"{key}={other}"): not default,
             ("--config", str(config)): not default,
             ("--config", str(config), flag, "on" if default else "off"): default}
    for extra, want in cases.items():
        parser = argparse.ArgumentParser()
        add_mount_arguments(parser)
        args = parser.parse_args(["http://x/a.tar", str(tmp_path / "mnt"),
                                  "--cache-dir", str(tmp_path / "cache"), *extra])
        policy = _mount_config(mount_settings(args)).policy
        assert getattr(policy, field) is want, extra


def test_in_place_from_flag_option_and_file(tmp_path: Path):
    """`--in-place off|on|auto`, `-o in_place[=...]` and `in_place:` (a YAML boolean too)
    reach the mount's settings; the default is auto; anything else is refused."""
    import argparse

    from shardfs.cli.config import ConfigError, validate
    from shardfs.cli.main import _mount_config, add_mount_arguments, mount_settings

    config = tmp_path / "c.yaml"
    cases = {(): "auto", ("--in-place", "on"): "on", ("--in-place", "auto"): "auto",
             ("-o", "in_place"): "on", ("-o", "in_place=auto"): "auto",
             ("-o", "in_place=false"): "off", ("--config", str(config)): "on",
             ("--config", str(config), "--in-place", "off"): "off"}
    config.write_text("in_place: true\n")
    for extra, want in cases.items():
        parser = argparse.ArgumentParser()
        add_mount_arguments(parser)
        args = parser.parse_args(["file:///data/a.tar", str(tmp_path / "mnt"),
                                  "--cache-dir", str(tmp_path / "cache"), *extra])
        assert _mount_config(mount_settings(args)).in_place == want, extra
    with pytest.raises(ConfigError, match=r"in_place: bad value 'sometimes'.*auto, on or off"):
        validate({"in_place": "sometimes"}, "-o")


def test_cold_start_from_flag_option_and_file(tmp_path: Path):
    """`--cold-start S`, `-o cold_start=S` and `cold_start:` reach the read policy (default
    1 s; 0 switches it off); a negative or non-numeric value is refused with the rule."""
    import argparse

    from shardfs.cli.main import _mount_config, add_mount_arguments, mount_settings

    config = tmp_path / "c.yaml"
    config.write_text("cold_start: 0\n")
    cases = {(): 1.0, ("--cold-start", "2.5"): 2.5, ("-o", "cold_start=0"): 0.0,
             ("--config", str(config)): 0.0,
             ("--config", str(config), "--cold-start", "0.5"): 0.5}
    for extra, want in cases.items():
        parser = argparse.ArgumentParser()
        add_mount_arguments(parser)
        args = parser.parse_args(["http://x/a.tar", str(tmp_path / "mnt"),
                                  "--cache-dir", str(tmp_path / "cache"), *extra])
        assert _mount_config(mount_settings(args)).policy.cold_start_s == want, extra
    for bad in ("-1\n", "soon\n", "true\n"):
        config.write_text(f"cold_start: {bad}")
        with pytest.raises(ConfigError, match="cold_start: bad value"):
            load_file(config)
