"""Offline-by-default environment of the entry points."""

import pytest

from sparse_llm.cli import env


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*env.OFFLINE_VARIABLES, "WANDB_SILENT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_offline_by_default(clean_env):
    import os

    env.apply_defaults(["model=1b", "l1=1e-5"])
    assert all(os.environ[name] == "1" for name in env.OFFLINE_VARIABLES)


def test_hub_dataset_keeps_the_hub_reachable(clean_env):
    import os

    env.apply_defaults(["data=fineweb_edu"])
    assert all(os.environ[name] == "0" for name in env.OFFLINE_VARIABLES)


def test_user_setting_wins(clean_env):
    import os

    clean_env.setenv("HF_HUB_OFFLINE", "0")
    env.apply_defaults([])
    assert os.environ["HF_HUB_OFFLINE"] == "0" and os.environ["HF_DATASETS_OFFLINE"] == "1"
