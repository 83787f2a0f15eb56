"""analysis.check_runs: runs made again against committed runs of the same cells, exactly."""

import json

from analysis.check_runs import main


def _run(root, cell, grad_norm=0.5, step_time=1.0, final_reward=0.4):
    run = root / cell
    run.mkdir(parents=True)
    lines = [{"step": i + 1, "reward": 0.25 * i, "grad_norm": grad_norm, "step_time": step_time * (i + 1)}
             for i in range(3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run / "eval.jsonl").write_text(json.dumps({"step": 3, "eval/accuracy": 0.5}) + "\n")
    (run / "summary.json").write_text(json.dumps({"status": "ok", "verdict": "stable", "steps": 3,
                                                   "final_reward": final_reward, "wall_s": step_time}))


def test_identical_runs_pass_whatever_their_timings(tmp_path, capsys):
    _run(tmp_path / "ref", "m/none/seed0")
    _run(tmp_path / "new", "m/none/seed0", step_time=7.0)
    _run(tmp_path / "new", "m/fp32/seed0")  # no committed counterpart: listed, not compared
    assert main(["--runs", str(tmp_path / "new"), "--reference", str(tmp_path / "ref"),
                 "--out", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "m/none/seed0: identical" in out and "m/fp32/seed0: no reference run" in out
    assert json.loads((tmp_path / "c.json").read_text())["cells"]["m/none/seed0"] == "identical"


def test_one_bit_of_one_logged_value_is_a_difference(tmp_path, capsys):
    _run(tmp_path / "ref", "m/none/seed0", grad_norm=0.5)
    _run(tmp_path / "new", "m/none/seed0", grad_norm=0.5000000000000001, final_reward=0.41)
    assert main(["--runs", str(tmp_path / "new"), "--reference", str(tmp_path / "ref")]) == 1
    out = capsys.readouterr().out
    assert "metrics record 1: grad_norm" in out and "summary: final_reward" in out


def test_nothing_to_compare_is_an_error(tmp_path):
    _run(tmp_path / "new", "m/none/seed0")
    (tmp_path / "ref").mkdir()
    assert main(["--runs", str(tmp_path / "new"), "--reference", str(tmp_path / "ref")]) == 2


def test_a_missing_folder_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    import pytest

    _run(tmp_path / "new", "m/none/seed0")
    with pytest.raises(SystemExit) as stop:
        main(["--runs", str(tmp_path / "new"), "--reference", str(tmp_path / "nope"), "--out", str(tmp_path / "c.json")])
    assert stop.value.code == 2 and f"{tmp_path / 'nope'} is not a folder" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


def test_provenance_names_the_cpu_type_its_bf16_bits_depend_on(tmp_path):
    """Every result's provenance records the CPU type (vendor, model, the BF16/FP16 instruction-set
    features kernels are chosen by): runs reproduce bitwise only within one type, so a comparison must be
    able to tell (issue 56: one CPU type for every run of the comparison)."""
    from rpa.core.provenance import CPU_FEATURES, cpu_info, provenance

    info = cpu_info()
    assert set(info) == {"vendor", "model", "cores", "features"} and set(info["features"]) <= set(CPU_FEATURES)
    flags = set()
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        pass
    assert info["features"] == [f for f in CPU_FEATURES if f in flags]
    assert provenance()["cpu"] == info


def test_check_tables_matches_rows_by_the_shortest_unique_label(tmp_path):
    """Review finding (issue 55): a table whose first two columns repeat (diagnose.csv: model, config, then
    layer and boundary) is matched by the shortest unique prefix, so a changed cell in any row is named."""
    from analysis.check_tables import compare_table

    header = "model,config,layer,boundary,value\n"
    rows = [f"m,all,{layer},{b},{layer}.{i}\n" for layer in range(3) for i, b in enumerate(("attn", "mlp"))]
    ref, fresh = tmp_path / "ref.csv", tmp_path / "fresh.csv"
    ref.write_text(header + "".join(rows))
    changed = list(rows)
    changed[3] = changed[3].replace("1.1", "1.2")
    fresh.write_text(header + "".join(changed))
    assert compare_table(ref, fresh) == ["ref.csv: row m/all/1/mlp column value: reference 1.1, fresh 1.2"]
    fresh.write_text(header + "".join(rows))
    assert compare_table(ref, fresh) == []
