import json

import pytest

from deploy.cli import main


def test_demo_replays_and_checks_every_hit(capsys):
    assert main(["demo", "--requests", "30", "--tokens-per-block", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["requests"] == 30 and out["output_mismatches"] == 0
    assert out["hit_tokens"] == out["hit_tokens_device"] + out["hit_tokens_host"] > 0


@pytest.mark.parametrize("argv", [["demo", "--requests", "0"], ["demo", "--host-pages", "-1"],
                                  ["bench", "nothing"], ["frobnicate"]])
def test_bad_arguments_exit_with_usage(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
