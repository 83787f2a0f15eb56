"""``rpa convert``: a GGUF file (a tiny one written here with ``gguf.GGUFWriter``, laid out as
llama.cpp lays out SmolLM2's) dequantized through transformers' own loader into an FP32
checkpoint both engines load."""

import hashlib
import json
from importlib.metadata import version

import pytest
import torch

from rpa.core.errors import InputError
from rpa.sides.convert import SOURCE_FILE, GgufSource, convert_gguf
from rpa.sides.tiny import TinySpec, build_tiny
from rpa.sides.trainer import UnsupportedModelError
from tests.conftest import run_py, tail
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    model = build_tiny(root / "llama", TinySpec(arch="llama", num_hidden_layers=2, tie_word_embeddings=True))
    path = root / "tiny-llama.Q4_1.gguf"
    expected = write_tiny_gguf(model, path)
    return {"model": model, "path": path, "expected": expected}


def test_the_conversion_holds_the_dequantized_weights_bit_for_bit(tiny_gguf, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / "converted"
    record = convert_gguf(GgufSource(file=str(tiny_gguf["path"])), out)
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert getattr(config, "quantization_config", None) is None and config.dtype == torch.float32
    assert config.num_hidden_layers == 2 and config.tie_word_embeddings
    weights = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())
    expected = tiny_gguf["expected"]
    assert set(expected) <= set(weights)
    for name, want in expected.items():
        assert torch.equal(weights[name], want), name  # Q4_1 / Q8_0 dequantized, q/k un-permuted: bitwise
    # the quantization is real: most dequantized tensors are not the tiny model's BF16 weights
    original = load_file(str(tiny_gguf["model"] / "model.safetensors"))
    changed = [n for n in expected if not torch.equal(original[n].float(), expected[n])]
    assert len(changed) >= 14, changed
    assert not any(torch.equal(w.to(torch.bfloat16).float(), w) for n, w in expected.items() if n in changed[:3])
    # tokenizer, chat template and generation config travel with it
    ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_gguf["model"])
    text = "What is 12 + 7? Answer: 19, sort 3 1 2 -> 1 2 3"
    assert ours(text, add_special_tokens=False).input_ids == theirs(text, add_special_tokens=False).input_ids
    assert ours.eos_token == "<|im_end|>" and ours.chat_template
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    assert (out / "generation_config.json").is_file()
    # provenance
    assert record == json.loads((out / SOURCE_FILE).read_text())
    assert record["sha256"] == hashlib.sha256(tiny_gguf["path"].read_bytes()).hexdigest()
    assert record["tensor_types"] == {"F32": 5, "Q4_1": 14, "Q8_0": 1} and record["dequantized"] is True
    assert record["architecture"] == "llama" and record["package"] is None and record["stored_dtype"] == "float32"


def test_converting_again_does_nothing_and_another_file_is_refused(tiny_gguf, tmp_path):
    out = tmp_path / "converted"
    convert_gguf(GgufSource(file=str(tiny_gguf["path"])), out)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    again = convert_gguf(GgufSource(file=str(tiny_gguf["path"])), out)
    assert again["sha256"] and (out / "model.safetensors").stat().st_mtime_ns == stamp  # nothing rewritten
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny_gguf["path"].read_bytes() + b"\0" * 32)  # same tensors, another file
    with pytest.raises(InputError, match="holds the conversion of another GGUF file"):
        convert_gguf(GgufSource(file=str(other)), out)
    with pytest.raises(InputError, match="sha256 .* differs from the required"):
        convert_gguf(GgufSource(file=str(tiny_gguf["path"]), sha256="0" * 64), tmp_path / "x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not a converted checkpoint"):
        convert_gguf(GgufSource(file=str(tiny_gguf["path"])), tmp_path / "busy")


def test_a_gguf_of_an_unsupported_architecture_is_refused_before_any_tensor_loads(tiny_gguf, tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(tiny_gguf["model"], path, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'"):
        convert_gguf(GgufSource(file=str(path)), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(InputError, match="not a readable GGUF file"):
        convert_gguf(GgufSource(file=str(bad)), tmp_path / "out")


def test_a_packaged_file_is_found_through_the_distribution_without_importing_it():
    pyyaml = version("PyYAML")
    assert GgufSource(package="PyYAML", version=pyyaml, file="yaml/__init__.py").locate().is_file()
    with pytest.raises(InputError, match="version .* is installed, 0.0 is required"):
        GgufSource(package="PyYAML", version="0.0", file="yaml/__init__.py").locate()
    with pytest.raises(InputError, match="'no-such-dist' is not installed"):
        GgufSource(package="no-such-dist", file="x.gguf").locate()
    with pytest.raises(InputError, match="in the distribution PyYAML: no such file"):
        GgufSource(package="PyYAML", file="yaml/missing.gguf").locate()


def test_the_cli_converts_and_refuses_in_one_line(tiny_gguf, tmp_path):
    out = tmp_path / "cli"
    proc = run_py(["-m", "rpa.cli", "convert", "--gguf", str(tiny_gguf["path"]), "--out", str(out)])
    assert proc.returncode == 0, tail(proc)
    assert "14 Q4_1" in proc.stdout and "dequantized to an FP32 checkpoint" in proc.stdout
    proc = run_py(["-m", "rpa.cli", "convert", "--gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "y")])
    assert proc.returncode == 2 and "no such file" in proc.stderr and "Traceback" not in proc.stderr, tail(proc)


def test_every_result_names_the_converted_models_source(tiny_gguf, tmp_path):
    """provenance(model) carries the conversion's record (package, version, sha256, tensor types,
    dequantized), and a warm start's record leads back to it."""
    from rpa.core.provenance import model_source, provenance

    out = tmp_path / "converted"
    record = convert_gguf(GgufSource(file=str(tiny_gguf["path"])), out)
    source = provenance(out)["model_source"]
    assert source["kind"] == "gguf" and source["sha256"] == record["sha256"] and source["dequantized"] is True
    assert source["tensor_types"] == record["tensor_types"]
    init = tmp_path / "init"
    init.mkdir()
    (init / "rpa_init.json").write_text(json.dumps({"source": str(out), "warm_start_losses": []}))
    assert model_source(init)["source"]["sha256"] == record["sha256"]
    assert model_source(tmp_path / "elsewhere") == {"path": str(tmp_path / "elsewhere")}
    assert "model_source" not in provenance()


def test_a_second_conversion_into_the_same_out_is_refused_before_any_work(tiny_gguf, tmp_path):
    """Issue 67: a second ``rpa convert`` started while the first runs converted everything again and died with
    "Directory not empty", leaving a full ``.<out>.converting`` copy. The lock beside the output refuses it in one
    line, before the file is even hashed."""
    import subprocess
    import sys
    import time

    out = tmp_path / "model"
    lock = tmp_path / ".model.convert.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); f.write('pid 1'); f.flush(); print('held', flush=True); "
                               "time.sleep(60)", str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        proc = run_py(["-m", "rpa.cli", "convert", "--gguf", str(tiny_gguf["path"]), "--out", str(out)])
        assert proc.returncode == 2, tail(proc)
        assert "in use by a running rpa convert" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert not out.exists() and not (tmp_path / ".model.converting").exists()
        assert time.monotonic() - start < 60
    finally:
        holder.kill()
        holder.wait()
    proc = run_py(["-m", "rpa.cli", "convert", "--gguf", str(tiny_gguf["path"]), "--out", str(out)])
    assert proc.returncode == 0, tail(proc)  # the holder gone, the conversion runs
    assert (out / "rpa_source.json").is_file() and not (out / ".lock").exists()
    assert not (tmp_path / ".model.converting").exists()


def test_a_directory_or_a_gguf_without_tensors_is_refused_in_one_line(tiny_gguf, tmp_path):
    """Issue 67: ``--gguf <a directory>`` said "no such file"; a GGUF with its architecture metadata but no tensors
    ended in a traceback and left its ``.converting`` folder behind."""
    proc = run_py(["-m", "rpa.cli", "convert", "--gguf", str(tmp_path), "--out", str(tmp_path / "x")])
    assert proc.returncode == 2 and "is a directory, not a GGUF file" in proc.stderr, tail(proc)
    empty = tmp_path / "empty.gguf"
    write_tiny_gguf(tiny_gguf["model"], empty, tensors=False)
    out = tmp_path / "model"
    proc = run_py(["-m", "rpa.cli", "convert", "--gguf", str(empty), "--out", str(out)])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and str(empty) in lines[0], tail(proc)
    assert not out.exists() and not (tmp_path / ".model.converting").exists()
