"""``rpa`` command line: a thin layer over the library."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Checked:
    """What :func:`_check_inputs` validated, each object built once from the flags and job file and
    handed to the command (no command builds its configuration again)."""

    numerics: Any = None  # NumericsConfig of a measuring command
    options: Any = None  # the command's options dataclass (ProbeOptions, ParityOptions, TinySpec, GgufSource, ...)
    configs: list[Any] = field(default_factory=list)  # the run configs of train / warm-start (TrainConfig)


def _cmd_tiny(args: argparse.Namespace, checked: Checked) -> int:
    from rpa.sides.tiny import build_tiny

    spec = checked.options
    out = build_tiny(args.out, spec)
    print(f"rpa tiny: wrote {spec.arch} model ({spec.num_hidden_layers} layers, hidden {spec.hidden_size}) to {out}")
    return 0


def _gguf_source(args: argparse.Namespace):
    from rpa.sides.convert import GgufSource

    return GgufSource(file=args.gguf, package=args.package, version=args.version, sha256=args.sha256)


def _cmd_convert(args: argparse.Namespace, checked: Checked) -> int:
    from rpa.sides.convert import convert_gguf

    record = convert_gguf(checked.options, args.out)
    types = ", ".join(f"{n} {t}" for t, n in record["tensor_types"].items())
    origin = f"{record['package']} {record['version']}: " if record["package"] else ""
    print(f"rpa convert: {origin}{record['file']} ({record['architecture']}, {record['tensors']} tensors: {types}; "
          f"sha256 {record['sha256'][:12]}...) dequantized to an FP32 checkpoint -> {args.out}")
    return 0


def _task_spec(args: argparse.Namespace):
    from dataclasses import fields

    from rpa.core.fieldtypes import build
    from rpa.train.tasks import TaskSpec

    return build(TaskSpec, {"name": args.task, **{f.name: getattr(args, f.name) for f in fields(TaskSpec)
                                                  if f.name != "name"}})


def _cmd_prompts(args: argparse.Namespace, checked: Checked) -> int:
    import json
    from pathlib import Path

    from rpa.core.jsonfiles import write_text
    from rpa.train.tasks import build_task

    rows = build_task(checked.options).rows
    write_text(Path(args.out), "".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n"
                                       for r in rows))
    print(f"rpa prompts: {len(rows)} prompts of task {args.task} -> {args.out}")
    return 0


def _parity_numerics(args: argparse.Namespace):
    from rpa.core.numerics_config import NumericsConfig

    return NumericsConfig.from_dict({"regions": args.regions, "device": args.device})


def _parity_options(args: argparse.Namespace):
    from rpa.core.fieldtypes import from_args
    from rpa.measure.parity import ParityOptions

    return from_args(ParityOptions, args)


def _cmd_parity(args: argparse.Namespace, checked: Checked) -> int:
    from rpa.measure.parity import run_parity

    report = run_parity(args.model, checked.numerics, args.out, checked.options)
    if not report["plugin"]["active"]:
        print(f"rpa parity: FAIL, plugin not active:\n{report['plugin']['error']}", file=sys.stderr)
        return 2
    for region, r in report["regions_report"].items():
        verdict = "bitwise equal" if r["bitwise_equal"] else "DIFFERS"
        print(f"  {region:8s} {verdict:13s} calls={r['calls']} elements={r['elements_checked']} "
              f"equal={r['elements_equal']} max_abs_diff={r['max_abs_diff']:g}")
    for name, gap in report.get("compiled_vs_eager", {}).items():
        verdict = "bitwise equal" if gap["bitwise_equal"] else "DIFFERS"
        gated = "" if gap["gated"] else " [not gated: a partial region set leaves stock ops to Inductor's fusion]"
        print(f"  {name} vs eager engine: {verdict} ({gap['tokens']} prompt logprobs, max |d| "
              f"{gap['max_abs_dlogp']:g}){gated}")
    lp = report["logprobs"]
    print(f"  logprobs (whole model, not gated): mean|dlogp|={lp['mean_abs_dlogp']:.3g} "
          f"max={lp['max_abs_dlogp']:.3g} bitwise={lp['frac_bitwise_equal']:.3f}")
    print(f"rpa parity: {'PASS' if report['passed'] else 'FAIL'} ({report['regions']}, {report['mode']}) -> {args.out}")
    return 0 if report["passed"] else 1


def _numerics(args: argparse.Namespace):
    from rpa.core.numerics_config import NumericsConfig

    dose = None if args.sampler_mantissa_bits is None else {"mantissa_bits": args.sampler_mantissa_bits}
    return NumericsConfig.from_dict({"regions": args.regions, "sampler_perturbation": dose,
                                     **{name: getattr(args, name) for name in NUMERICS_FLAGS}})


def _probe_options(args: argparse.Namespace):
    from rpa.core.fieldtypes import from_args
    from rpa.measure.probe import ProbeOptions

    return from_args(ProbeOptions, args)


def _cmd_probe(args: argparse.Namespace, checked: Checked) -> int:
    from rpa.measure.probe import run_probe

    s = run_probe(args.model, checked.numerics, args.out, checked.options, completions_path=args.completions,
                  replace=args.replace)
    bv = s["trainer_batch_variance"]["batch_vs_single"]
    full = "n/a" if s["full_kl"] is None else f"{s['full_kl']:.3g}"
    print(f"rpa probe: {s['config']['numerics']}: tokens={s['tokens']} mean|dlogp|={s['mean_abs_dlogp']:.4g} "
          f"p99={s['p99_abs_dlogp']:.4g} max={s['max_abs_dlogp']:.4g} bitwise={s['frac_bitwise_equal']:.3f} "
          f"kl_k3={s['kl_k3']:.3g} full_kl={full}; trainer batch vs batch-1 mean|d|={bv['mean_abs_dlogp']:.3g} "
          f"-> {args.out}/summary.json")
    return 0


NUMERICS_FLAGS = ("precision", "lm_head_fp32", "trainer_mode", "trainer_positions", "aligned_sides", "trainer_attention",
                  "trainer_precision", "device")
"""The NumericsConfig fields that are plain flags (regions and the perturbation have their own)."""


def _add_numerics_args(parser: argparse.ArgumentParser) -> None:
    from rpa.core.fieldtypes import add_arguments
    from rpa.core.numerics_config import NumericsConfig

    parser.add_argument("--regions", help="'none', 'all' or a comma-separated subset of rope,swiglu,rmsnorm; required")
    add_arguments(parser, NumericsConfig, names=NUMERICS_FLAGS)  # defaults, help and choices of the dataclass
    parser.add_argument("--sampler-mantissa-bits", type=int, metavar="K",
                        help="PERTURBATION (positive control, never the method): round the sampler's region "
                             "outputs to K of BF16's 7 mantissa bits; the trainer is untouched")


def _add_device_arg(parser: argparse.ArgumentParser) -> None:
    from rpa.core.fieldtypes import add_arguments
    from rpa.core.numerics_config import NumericsConfig

    add_arguments(parser, NumericsConfig, names=("device",))


def _sequences(args: argparse.Namespace) -> list[list[int]]:
    """Diagnose's token sequences (read once: the input check and the command share them)."""
    if getattr(args, "_sequences", None) is None:
        from rpa.measure.diagnose import sequences_from

        args._sequences = sequences_from(args.completions, args.model, args.sequences, args.seed)
    return args._sequences


def _cmd_diagnose(args: argparse.Namespace, checked: Checked) -> int:
    from rpa.measure.diagnose import format_table, read_layers, run_diagnose

    s = run_diagnose(args.model, checked.numerics, args.out, _sequences(args), seed=args.seed, replace=args.replace)
    print(format_table(read_layers(f"{args.out}/layers.csv")))
    first = s["first_divergence"]
    where = "none (bitwise equal everywhere)" if first is None else f"layer {first['layer']} {first['boundary']}"
    print(f"rpa diagnose: {s['config']['numerics']}: first divergence at {where} -> {args.out}/layers.csv")
    return 0


def _attribution_options(args: argparse.Namespace):
    from rpa.core.fieldtypes import from_args
    from rpa.measure.attribution import AttributionOptions

    return from_args(AttributionOptions, args)


def _cmd_attribute(args: argparse.Namespace, checked: Checked) -> int:
    from rpa.measure.attribution import run_attribution

    s = run_attribution(args.model, checked.numerics, args.out, args.completions, checked.options,
                        replace=args.replace)
    base = s["rungs"]["trainer"]["mean_abs_dlogp"]
    for rung, r in s["rungs"].items():
        # a trainer already bitwise equal to vLLM (base 0) has no relative change to print
        change = f"{100 * (r['mean_abs_dlogp'] / base - 1):+.1f}% vs trainer" if base else "trainer gap 0"
        print(f"  {rung:20s} mean|dlogp|={r['mean_abs_dlogp']:.4g} ({change}) bitwise={r['frac_bitwise_equal']:.3f}")
    print(f"rpa attribute: {s['config']['numerics']['regions']}: {s['tokens']} tokens of {s['sequences']} sequences "
          f"-> {args.out}/summary.json")
    return 0


def _cmd_train(args: argparse.Namespace, checked: Checked) -> int:
    from rpa.train.grpo import run_train, run_trains

    cfgs = checked.configs
    if len(cfgs) == 1:
        results = [run_train(cfgs[0], args.out[0])]  # its own failure propagates, as it always has
    else:
        results = run_trains(list(zip(cfgs, args.out)))
    failed = 0
    for s, out in zip(results, args.out):
        if isinstance(s, Exception):
            failed += 1
            print(f"rpa train: {out}: failed: {s!r}", file=sys.stderr)
            continue
        if "rank" in s:  # another process of a multi-process run: rank 0 reports
            continue
        verdict = f"collapsed at step {s['collapse_step']} ({s['collapse_reason']})" if s["collapsed"] \
            else "no collapse"
        print(f"rpa train: {s['steps']} logged steps, {verdict}; peak reward {s.get('peak_reward')}, "
              f"final (smoothed) {s.get('final_reward')}, AUC {s.get('reward_auc')}; {s['wall_s']} s -> {out}")
    return 1 if failed else 0


def _cmd_warm_start(args: argparse.Namespace, checked: Checked) -> int:
    from rpa.train.grpo import run_warm_start

    cfg = checked.configs[0]
    info = run_warm_start(cfg, args.out)
    losses = info.get("warm_start_losses") or [float("nan")]
    print(f"rpa warm-start: {len(info.get('warm_start_losses', []))} supervised steps, final loss {losses[-1]:.3g} "
          f"-> {args.out}")
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse with an error in one line (``rpa <command>: error: ...``, exit 2) instead of the
    usage block: the one-line form of every other refusal."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from rpa.measure.diagnose import DiagnoseOptions
    from rpa.core.fieldtypes import add_arguments
    from rpa.measure.parity import ParityOptions
    from rpa.measure.probe import ProbeOptions
    from rpa.sides.tiny import TinySpec

    parser = OneLineParser(prog="rpa", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)  # subcommands: the same one-line class

    tiny = sub.add_parser("tiny", help="build a tiny random Qwen2/Qwen3/Llama model + local tokenizer")
    tiny.add_argument("--out", required=True, help="output directory")
    add_arguments(tiny, TinySpec)
    tiny.set_defaults(func=_cmd_tiny)

    convert = sub.add_parser("convert", help="dequantize a GGUF file (a path, or a file an installed package ships) "
                                             "into an FP32 Hugging Face checkpoint")
    from rpa.sides.convert import GgufSource

    convert.add_argument("--gguf", required=True, metavar="FILE",
                         help=GgufSource.__dataclass_fields__["file"].metadata["help"])
    add_arguments(convert, GgufSource, names=("package", "version", "sha256"))
    convert.add_argument("--out", required=True, help="output checkpoint directory")
    convert.set_defaults(func=_cmd_convert)

    prompts = sub.add_parser("prompts", help="write a task's training prompts (and answers) as a prompts file for "
                                             "rpa probe --prompts-file")
    from rpa.train.tasks import TASKS, TaskSpec

    prompts.add_argument("--task", default="synthetic-add", choices=TASKS, help="the task (default: synthetic-add)")
    add_arguments(prompts, TaskSpec, names=tuple(f for f in TaskSpec.__dataclass_fields__ if f != "name"))
    prompts.add_argument("--out", required=True, help="output JSON-lines file")
    prompts.set_defaults(func=_cmd_prompts)

    parity = sub.add_parser("parity", help="fail-closed bitwise check of region numerics, vLLM vs trainer")
    parity.add_argument("--model", help="model directory (or hub id); required")
    parity.add_argument("--regions", help="'all' or a comma-separated subset of rope,swiglu,rmsnorm; required")
    parity.add_argument("--out", help="JSON report path; required")
    add_arguments(parity, ParityOptions)  # one flag per field, default and help from the dataclass
    _add_device_arg(parity)
    parity.set_defaults(func=_cmd_parity)

    from rpa.measure.attribution import AttributionOptions

    def measuring(name: str, help_text: str, out: str, completions: str, options: type, func) -> argparse.ArgumentParser:
        """A command that measures the two engines on a model in one numerics configuration."""
        command = sub.add_parser(name, help=help_text)
        command.add_argument("--model", help="model directory (or hub id); required")
        _add_numerics_args(command)
        command.add_argument("--out", help=f"output directory ({out}); required")
        command.add_argument("--completions", help=completions)
        command.add_argument("--replace", action="store_true",
                             help="run again into --out whatever it holds: its earlier summary and recorded options "
                                  "give way (the workflow's rules pass this once Snakemake has decided a job reruns); "
                                  "without it a finished run is kept and one made with other options is refused")
        add_arguments(command, options)  # one flag per field, default and help from the dataclass
        command.set_defaults(func=func)
        return command

    probe = measuring("probe", "sample with vLLM, rescore with the trainer, write mismatch metrics",
                      "summary.json, tokens.csv", "score these fixed completions (a completions.jsonl of another "
                      "probe run) instead of sampling", ProbeOptions, _cmd_probe)
    diag = measuring("diagnose", "per-layer, per-region-boundary hidden-state divergence, vLLM vs trainer",
                     "layers.csv, summary.json", "take token sequences (prompt + completion) from a probe's "
                     "completions.jsonl", DiagnoseOptions, _cmd_diagnose)
    attr = measuring("attribute", "which unaligned kernel carries the rest of the mismatch: every op replayed on "
                     "vLLM's inputs, and the trainer rescored with vLLM's own GEMMs / LM head, rung by rung",
                     "tokens.csv, ops.csv, summary.json", "the token sequences to score (a probe's "
                     "completions.jsonl); required", AttributionOptions, _cmd_attribute)

    train = sub.add_parser("train", help="GRPO run (TRL + colocated vLLM) with one numerics configuration")
    train.add_argument("--config", required=True, action="append",
                       help="run config YAML (see experiments/train/); repeated with --out for several runs in one "
                            "process (one region set: a grid's seeds of one arm share the imports and the vLLM engine)")
    train.add_argument("--out", required=True, action="append",
                       help="run directory (resumes from its last checkpoint); one per --config, in order")
    train.set_defaults(func=_cmd_train)

    warm = sub.add_parser("warm-start", help="only the supervised warm start of a run config, as a shared "
                                             "starting checkpoint")
    warm.add_argument("--config", required=True, help="run config YAML (model, task, warm_start, seed)")
    warm.add_argument("--out", required=True, help="output model directory")
    warm.set_defaults(func=_cmd_warm_start)
    parser.job_parsers = {"parity": parity, "probe": probe, "diagnose": diag, "attribute": attr}  # --config too
    for job in parser.job_parsers.values():
        job.add_argument("--config", help="a YAML mapping of this command's options, one job in one file (keys: the "
                                          "flags' names with _ for -); flags given here override it")
    return parser


JOB_REQUIRED = ("model", "regions", "out")


def _with_job_config(parser: argparse.ArgumentParser, argv: list[str] | None,
                     args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the command's ``--config`` file as the defaults under the flags given, and
    the options every job needs present (from either)."""
    from rpa.core.errors import InputError

    job = parser.job_parsers.get(args.command)
    if job is None:
        return args
    if args.config:
        from rpa.core.yamlfiles import load_yaml

        values = load_yaml(args.config)  # one line naming file, line and column; duplicate keys refused
        if not isinstance(values, dict):
            raise InputError(f"--config {args.config}: expected a mapping of options")
        known = {a.dest for a in job._actions if a.dest not in ("help", "config")}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InputError(f"--config {args.config}: unknown option(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(sorted(known))}")
        job.set_defaults(**values)
        args = parser.parse_args(argv)
    missing = [k for k in JOB_REQUIRED if hasattr(args, k) and getattr(args, k) is None]
    if missing:
        raise InputError(f"{', '.join('--' + k for k in missing)} required (as flags or in --config)")
    return args


def top_k_problem(top_k: int, config) -> str | None:
    """Why a ``top_k`` cannot be sampled with on a model of ``config``'s vocabulary, in one line: one that keeps the
    whole vocabulary truncates nothing (off is -1) and vLLM refuses one above it once started."""
    vocab = getattr(config, "vocab_size", None)
    if vocab and top_k > 0 and top_k >= int(vocab):
        return (f"top_k {top_k} keeps the model's whole vocabulary ({vocab} tokens): it truncates nothing; use -1 "
                "(off) or a smaller k")
    return None


def _check_inputs(args: argparse.Namespace) -> Checked:
    """Everything that can be checked before a model or an engine loads or an output is made:
    option ranges, the model checkpoint (config, architecture, whole weights, tokenizer), input
    files (and their token ids against the model's vocabulary), the output path, and a run
    config with its context length against the model's. Each failure is one line, exit 2.
    Returns the validated objects the command then uses (:class:`Checked`): each command's checks
    are :data:`_CHECKS`'s, the model commands' (parity, probe, diagnose, attribute) :func:`_check_measurement`."""
    return _CHECKS.get(args.command, _check_measurement)(args)


def _check_convert(args: argparse.Namespace) -> Checked:
    from rpa.measure.inputs import check_output

    source = _gguf_source(args)
    source.locate()
    check_output(args.out, "dir", command="convert")
    return Checked(options=source)


def _check_prompts(args: argparse.Namespace) -> Checked:
    from rpa.measure.inputs import check_output

    spec = _task_spec(args)
    check_output(args.out, "file")
    return Checked(options=spec)


def _check_tiny(args: argparse.Namespace) -> Checked:
    from rpa.core.fieldtypes import from_args
    from rpa.measure.inputs import check_output
    from rpa.sides.tiny import TinySpec, check_target

    spec = from_args(TinySpec, args)
    spec.validate()
    check_output(args.out, "dir", command="tiny")
    check_target(args.out)
    return Checked(options=spec)


def _check_runs(args: argparse.Namespace) -> Checked:
    """train / warm-start: each run config against its model (context, top-k, the sync probe), one directory per
    config, and runs that share a process able to share its engine."""
    from rpa.core.errors import InputError
    from rpa.measure.inputs import check_model, check_output
    from rpa.train.config import TrainConfig

    pairs = list(zip(args.config, args.out)) if args.command == "train" else [(args.config, args.out)]
    if args.command == "train" and len(args.config) != len(args.out):
        raise InputError(f"{len(args.config)} --config and {len(args.out)} --out: one run directory per config")
    if args.command == "train" and len(set(map(os.path.abspath, args.out))) != len(args.out):
        raise InputError("--out: a run directory is named twice")
    cfgs = []
    for path, out in pairs:
        cfg = TrainConfig.from_yaml(path)
        if args.command == "warm-start" and cfg.warm_start.steps < 1:
            raise InputError(f"{path}: warm_start.steps is {cfg.warm_start.steps}: a warm start of no steps has "
                             f"nothing to write (start the runs from the model itself)")
        config = check_model(cfg.model)
        context = cfg.max_prompt_length + cfg.max_completion_length + cfg.vllm_context_slack
        limit = getattr(config, "max_position_embeddings", None)
        if args.command == "train" and limit and context > limit:
            raise InputError(f"{path}: max_prompt_length + max_completion_length + vllm_context_slack = "
                             f"{context} exceeds the model's max_position_embeddings ({limit})")
        problem = top_k_problem(cfg.top_k, config)
        if problem:
            raise InputError(f"{path}: {problem}")
        if args.command == "train" and cfg.sync_check.probe_tokens > context:
            raise InputError(f"{path}: sync_check.probe_tokens {cfg.sync_check.probe_tokens} is longer than the "
                             f"engine's context ({context} tokens)")
        check_output(out, "dir", inputs=(cfg.model, path), command=args.command)
        cfgs.append(cfg)
    if len(cfgs) > 1:
        from rpa.train.grpo import engine_problems

        problems = engine_problems(cfgs)
        if problems:
            raise InputError("these runs cannot share a process: " + "; ".join(problems))
    return Checked(configs=cfgs)


_CHECKS = {"convert": _check_convert, "prompts": _check_prompts, "tiny": _check_tiny, "train": _check_runs,
           "warm-start": _check_runs}
"""The commands whose checks are their own; every other command measures a model (:func:`_check_measurement`)."""


def _measurement_options(args: argparse.Namespace, numerics):
    """The options of parity, probe, diagnose or attribute, their ranges checked, and what each command asks of
    the numerics."""
    from rpa.core.errors import InputError
    from rpa.core.fieldtypes import from_args

    if args.command == "parity":
        options = _parity_options(args)  # the option values (a trainer_dtype from a job file is not an argparse choice)
        if not numerics.regions:
            raise InputError("parity needs at least one aligned region ('none' has nothing to check)")
        return options
    if args.command == "probe":
        return _probe_options(args)  # ranges of the probe's options
    if args.command == "diagnose":
        from rpa.measure.diagnose import DiagnoseOptions

        return from_args(DiagnoseOptions, args)  # ranges of diagnose's options
    if args.command == "attribute":
        options = _attribution_options(args)
        if not args.completions:
            raise InputError("--completions required (as a flag or in --config): the sequences to score")
        if numerics.precision != "bf16":
            raise InputError("attribute swaps BF16 kernels; --precision must be bf16")
        if numerics.trainer_precision != "same":
            raise InputError("attribute swaps vLLM's BF16 kernels into a BF16 trainer; --trainer-precision must be "
                             "same")
        return options
    return None


def _check_probe_against_model(options, config, completions) -> None:
    """The probe's options against its model and its sequences: top-k within the vocabulary, the engine's context
    within the model's, a prompts file long enough, and no part asking for more sequences than the probe has."""
    from rpa.core.errors import InputError

    limit = getattr(config, "max_position_embeddings", None)
    if top_k_problem(options.top_k, config):
        raise InputError(f"--{top_k_problem(options.top_k, config)}")
    if limit and options.max_model_len > limit:
        raise InputError(f"--max-model-len {options.max_model_len} exceeds the model's max_position_embeddings "
                         f"({limit})")
    if options.prompts_file and not completions:
        from rpa.measure.prompts import read_prompts

        count = len(read_prompts(options.prompts_file))  # one line naming the file and line, before any engine
        if count < options.prompts:
            raise InputError(f"--prompts-file {options.prompts_file}: {count} prompts, --prompts asks for "
                             f"{options.prompts}")


def _check_sequence_counts(options, completions, records) -> None:
    from rpa.core.errors import InputError

    sequences = len(records) if records is not None else options.prompts * options.samples
    for name in ("split_sequences", "decode_sequences", "batch_sequences"):
        asked = getattr(options, name)
        if asked is not None and asked > sequences:
            raise InputError(f"--{name.replace('_', '-')} {asked}: the probe has {sequences} sequences "
                             f"({'the completions file' if completions else '--prompts x --samples'})")


def _check_completions(args: argparse.Namespace, options, config, completions, records) -> None:
    """A completions file's token ids within the vocabulary, and its sequences within the engine's context."""
    from rpa.measure.inputs import check_lengths, check_token_ids

    limit = getattr(config, "max_position_embeddings", None)
    check_token_ids(records, int(config.vocab_size), completions)
    lengths = [(f"record seq {c['seq']} (prompt + completion)", len(c["prompt_ids"]) + len(c["completion_ids"]))
               for c in records]
    if args.command == "probe":
        check_lengths(lengths, options.max_model_len, f"completions {completions}",
                      "; raise --max-model-len" + (f" (up to the model's max_position_embeddings, {limit})"
                                                   if limit else ""))
    if args.command == "attribute":
        from rpa.sides.engine import engine_context

        check_lengths(lengths[: options.sequences], engine_context(config), f"completions {completions}")


def _check_recorded(args: argparse.Namespace, numerics, options, completions) -> None:
    """An output directory holding a result made with other options is refused (unless ``--replace``)."""
    from rpa.core.outdir import check_options

    if args.command == "probe":
        from rpa.measure.probe import recorded_options

        check_options(args.out, "probe", recorded_options(args.model, numerics, options, completions))
    elif args.command == "diagnose":
        from rpa.measure.diagnose import recorded_options

        check_options(args.out, "diagnose", recorded_options(args.model, numerics, _sequences(args), args.seed))
    elif args.command == "attribute":
        from rpa.measure.attribution import recorded_options

        check_options(args.out, "attribute", recorded_options(args.model, numerics, completions, options))


def _check_measurement(args: argparse.Namespace) -> Checked:
    """parity, probe, diagnose, attribute: the numerics and options, the model, the completions, the device and
    engine bounds (the checks that import vLLM last), the output and the options an earlier result recorded."""
    from rpa.measure.inputs import check_model, check_output

    numerics = _parity_numerics(args) if args.command == "parity" else _numerics(args)
    options = _measurement_options(args, numerics)
    config = check_model(args.model)
    completions = getattr(args, "completions", None)
    if args.command == "probe":
        _check_probe_against_model(options, config, completions)
    records = None
    if completions:
        from rpa.measure.scoring import load_completions

        records = load_completions(completions)
    if args.command == "probe":
        _check_sequence_counts(options, completions, records)
    if completions:
        _check_completions(args, options, config, completions, records)
    if args.command == "diagnose":
        from rpa.measure.diagnose import check_sequences

        check_sequences(_sequences(args), config, completions)  # as many as asked, each within the context
    # the checks that import vLLM (seconds) come after every check the inputs alone decide
    numerics.check_device()
    if args.command == "probe" and not completions:
        options.check_engine_bounds()
    check_output(args.out, "file" if args.command == "parity" else "dir",
                 inputs=tuple(x for x in (args.model, completions) if x), command=args.command)
    checked = Checked(numerics=numerics, options=options)
    if not getattr(args, "replace", False):  # else the earlier output gives way (rpa.core.outdir.claim)
        _check_recorded(args, numerics, options, completions)
    return checked


def main(argv: list[str] | None = None) -> int:
    from rpa.core.errors import UserError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args = _with_job_config(parser, argv, args)
        return args.func(args, _check_inputs(args))
    except UserError as err:
        print(f"rpa {args.command}: error: {err}", file=sys.stderr)
        return 2


def exit_now(code: int) -> None:
    """End the process with ``code`` once :func:`main` has returned, without the interpreter's
    teardown: after a run, collecting torch's, vLLM's and the engine's objects module by module
    takes ~1.5 s of CPU (measured on a 2-core CPU), paid by each of the ~100 processes of the
    CPU miniature. Everything a normal exit does that can matter still happens, in its order,
    through the two calls CPython's own exit makes: ``threading._shutdown`` (thread-pool
    executors told to stop, non-daemon threads joined), then ``atexit`` (logging's flush,
    vLLM's shutdown hooks, ``weakref.finalize`` clean-ups, multiprocessing's children); then
    stdout and stderr are flushed. Every result file is already closed and written atomically."""
    import atexit
    import threading

    threading._shutdown()  # private: what Py_FinalizeEx calls first
    atexit._run_exitfuncs()  # private: what it calls next
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def run() -> None:
    """The ``rpa`` console script (and ``python -m rpa.cli``): :func:`main`, then :func:`exit_now`.
    An exception :func:`main` does not handle (a bug) takes Python's normal exit, traceback
    and all."""
    exit_now(main())


if __name__ == "__main__":
    run()
