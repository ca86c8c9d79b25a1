"""scripts/bench_attention.py's plans stay buildable as the kernels' defaults and knobs change: every plan lists its
cases, and every configuration in them is one the kernel it names accepts at the case's head dim.

A plan that no longer enumerates (session 10's ``s10dims`` pinned its defaults with an assertion, which failed once
the defaults moved on) or that names a configuration the kernel refuses only fails on the GPU machine's side of a
run, after the build; this catches both here."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_attention  # noqa: E402
from stof_tvm.schedules.attention_blockwise import BlockConfig  # noqa: E402
from stof_tvm.schedules.attention_wgmma import WgmmaAttentionConfig  # noqa: E402

CONFIG_CLASSES = {"wgmma": WgmmaAttentionConfig, "block": BlockConfig}


@pytest.mark.parametrize("plan", sorted(bench_attention.PLANS))
def test_every_plan_lists_cases_whose_configurations_the_kernels_accept(plan):
    cases = bench_attention.PLANS[plan]()
    assert cases, f"plan {plan} lists no case"
    refused = []
    for case in cases:
        assert case["kind"] in ("check", "time"), case
        config_class = CONFIG_CLASSES.get(case["family"])
        if config_class is None or not case["config"]:
            continue
        try:
            config_class(*case["config"]).validate(case["head_dim"])
        except (TypeError, ValueError) as err:
            refused.append((case["family"], case["head_dim"], case["config"], str(err)))
    assert not refused, f"plan {plan}: {len(refused)} configurations refused, first {refused[0]}"
