"""``bench/learner_device.py`` (``make bench-device``) on the CPU with a tiny model: it
builds a random model of a directory's config, runs its rounds and prints the table."""

from __future__ import annotations

from script_loader import load_script


def test_rounds_on_the_cpu_print_the_table(tiny_model_dir, capsys):
    bench = load_script("bench/learner_device.py")
    assert bench.main(["--model-dir", str(tiny_model_dir), "--devices", "cpu",
                       "--reps", "2", "--tokens", "4", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert sum(line.startswith("rep ") for line in lines) == 2
    (row,) = [line.split() for line in lines if line.split()[:1] == ["cpu"]]
    generation, learner, round_s, ratio = map(float, row[1:])
    assert generation > 0 and learner > 0
    assert abs(round_s - (generation + learner)) < 2e-3  # printed to 3 decimals
    assert ratio == 1.0  # the first device is the reference
