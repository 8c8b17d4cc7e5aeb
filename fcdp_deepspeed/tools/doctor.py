"""``fcdp doctor``: is FCDP installed and on in this environment, and what would this config do?

    fcdp doctor                                   # the installation only
    fcdp doctor ds_config.json --nodes 4 --ranks-per-node 8     # or --config ds_config.json

Checks, each ``ok``, ``WARN`` or ``FAIL`` with what to do about it: the installed torch and DeepSpeed and
whether the version gate admits them; whether the startup file (``fcdp_deepspeed_autoload.pth``) is
installed where this interpreter runs it, and whether it ran here; the config read as DeepSpeed reads it
(hjson) and as the HF Trainer and accelerate read it (strict JSON); the ``"fcdp"`` block validated with
every problem listed at once (misplaced or misspelled blocks included); and, for a layout, the plan the
block resolves to (cache placement and budget, parameter gather, gradient modes, compression), through
the same functions an engine uses. Exit status 1 when any check fails.

Run it with the interpreter the job uses (``python -m fcdp_deepspeed.tools.doctor`` is the same command):
the startup file only runs in interpreters whose site-packages holds it.
"""
from __future__ import annotations

import json
import os
import site
import sys
from dataclasses import asdict, dataclass
from typing import Any, Optional

from fcdp_deepspeed.tools import args as checks

PTH = "fcdp_deepspeed_autoload.pth"
#: Whether the startup file ran in this interpreter: read before anything here imports the hook's modules.
HOOK_RAN_AT_START = "fcdp_deepspeed_autoload" in sys.modules


@dataclass
class Check:
    area: str
    status: str
    """``ok``, ``WARN`` or ``FAIL``."""
    message: str
    fix: str = ""


def _version(dist: str) -> Optional[str]:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _install_kind() -> str:
    from importlib import metadata
    try:
        text = metadata.distribution("fcdp-deepspeed").read_text("direct_url.json") or "{}"
    except metadata.PackageNotFoundError:
        return "no installed distribution (imported from a path)"
    editable = json.loads(text).get("dir_info", {}).get("editable", False)
    return "editable install" if editable else "installed"


def installation_checks() -> list[Check]:
    """The package, torch, DeepSpeed and the startup file."""
    import fcdp_deepspeed
    from fcdp_deepspeed.activation.version_gate import (ALLOW_UNTESTED_ENV, TESTED_DEEPSPEED_VERSIONS, TESTED_TORCH_VERSION,
                                             deepspeed_requirement, suggested_release, version_is_tested)
    from fcdp_deepspeed.version import __version__
    out = [Check("install", "ok", f"fcdp-deepspeed {__version__} ({_install_kind()}) at "
                                  f"{os.path.dirname(fcdp_deepspeed.__file__)}, Python {sys.version.split()[0]}")]
    torch_v = _version("torch")
    if torch_v is None:
        out.append(Check("install", "FAIL", "torch is not installed", "pip install torch (CI runs torch==2.13.0)"))
    else:
        tested = torch_v.split("+")[0] == TESTED_TORCH_VERSION
        out.append(Check("install", "ok" if tested else "WARN", f"torch {torch_v}" + (
            " (the release CI runs)" if tested else f": untested (CI runs {TESTED_TORCH_VERSION}; the package allows torch>=2.0)")))
    ds_v = _version("deepspeed")
    tested_list = ", ".join(TESTED_DEEPSPEED_VERSIONS)
    if ds_v is None:
        out.append(Check("install", "FAIL", "DeepSpeed is not installed",
                         f"pip install \"{deepspeed_requirement()}\" (tested: {tested_list})"))
    elif version_is_tested(ds_v):
        forced = ds_v.split("+")[0] not in TESTED_DEEPSPEED_VERSIONS
        out.append(Check("install", "WARN" if forced else "ok", f"deepspeed {ds_v}: " + (
            f"untested, admitted because {ALLOW_UNTESTED_ENV}=1" if forced else f"a tested release ({tested_list})")))
    else:
        out.append(Check("install", "FAIL", f"deepspeed {ds_v}: the version gate refuses it (tested: {tested_list}); "
                         f"a config with an enabled block fails at deepspeed.initialize",
                         f"pip install deepspeed=={suggested_release(ds_v)}, or {ALLOW_UNTESTED_ENV}=1 to run untested"))
    return out + startup_checks()


def startup_checks() -> list[Check]:
    """Whether the startup file is where this interpreter runs it, and whether it ran."""
    from fcdp_deepspeed.activation.autoload import AUTOLOAD_ENV, autoload_enabled
    dirs = [d for d in site.getsitepackages() + [site.getusersitepackages()] if d]
    found = [d for d in dirs if os.path.exists(os.path.join(d, PTH))]
    fallback = ("call fcdp_deepspeed.install() before building the model, or launch with "
                f"`python -m fcdp_deepspeed.run train.py ...` (activation in the documentation: "
                f"{checks.project_url() or 'docs/integrations.md of the source'})")
    out = []
    if found:
        out.append(Check("startup", "ok", f"startup file {PTH} in {found[0]}"))
    else:
        out.append(Check("startup", "FAIL", f"no {PTH} in this interpreter's site-packages ({', '.join(dirs)}): "
                         f"installed with `pip install --target`, via PYTHONPATH, or a copied checkout? Then nothing "
                         f"turns FCDP on and DeepSpeed ignores the \"fcdp\" block",
                         "pip install the package into this environment (no --target), or " + fallback))
    if HOOK_RAN_AT_START and autoload_enabled():
        out.append(Check("startup", "ok", "the startup file ran in this interpreter: importing deepspeed installs FCDP"))
    elif not autoload_enabled():
        out.append(Check("startup", "WARN", f"{AUTOLOAD_ENV}={os.environ.get(AUTOLOAD_ENV)}: the startup file installs "
                         f"nothing, so a config's \"fcdp\" block is ignored", f"unset {AUTOLOAD_ENV}, or " + fallback))
    elif sys.flags.no_site:
        out.append(Check("startup", "FAIL", "python -S: no site-packages startup files run",
                         "run without -S, or " + fallback))
    elif found:
        out.append(Check("startup", "FAIL", "the startup file did not run in this interpreter",
                         "check that this is the interpreter the package was installed into, or " + fallback))
    return out


def config_checks(path: str) -> tuple[list[Check], Optional[dict]]:
    """The config as DeepSpeed and as HF/accelerate read it, and every problem of its block."""
    import hjson
    try:
        with open(path) as f:
            text = f.read()
        cfg = hjson.loads(text)
    except (OSError, hjson.HjsonDecodeError) as err:
        return [Check("config", "FAIL", f"{path}: cannot be read as DeepSpeed reads it (hjson): {err}",
                      "give the path of a JSON/HJSON DeepSpeed config")], None
    if not isinstance(cfg, dict):
        return [Check("config", "FAIL", f"{path} holds {type(cfg).__name__}, not a config object")], None
    out = [Check("config", "ok", f"{path}: read as DeepSpeed reads it (hjson)")]
    try:
        json.loads(text)
    except ValueError as err:
        out.append(Check("config", "WARN", f"not strict JSON ({err}): HF TrainingArguments(deepspeed=path) and "
                         f"accelerate's DeepSpeedPlugin read it with json.load and fail",
                         "remove comments and trailing commas if the HF Trainer or accelerate uses this file"))
    return out + block_checks(dict(cfg)), dict(cfg)


def _zero_keys() -> list[str]:
    """Every key DeepSpeed's ``zero_optimization`` accepts (field names and their aliases)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    return sorted({k for name, f in DeepSpeedZeroConfig.model_fields.items() for k in (name, f.alias) if k})


def _zero_problem(e: dict) -> Check:
    """One of pydantic's errors of DeepSpeed's ``zero_optimization`` model as a FAIL naming the key and the fix."""
    loc = ".".join(str(p) for p in e.get("loc") or ())
    key, value, msg = f"zero_optimization.{loc}" if loc else "zero_optimization", e.get("input"), e.get("msg", "")
    if e.get("type") == "extra_forbidden":
        import difflib
        near = difflib.get_close_matches(loc.split(".")[-1], _zero_keys(), n=1, cutoff=0.6)
        return Check("deepspeed", "FAIL", f"{key} = {value!r}: DeepSpeed knows no such key"
                     f"{f' (did you mean {near[0]!r}?)' if near else ''}; deepspeed.initialize refuses the config",
                     f"rename it to zero_optimization.{near[0]}" if near else
                     "remove it (the keys DeepSpeed accepts: deepspeed.ai/docs/config-json)")
    if loc == "stage":
        return Check("deepspeed", "FAIL", f"{key} = {value!r}: {msg}; deepspeed.initialize refuses the config",
                     "set zero_optimization.stage to 3, a JSON number (FCDP runs on ZeRO stage 3)")
    return Check("deepspeed", "FAIL", f"{key} = {value!r}: {msg}; deepspeed.initialize refuses the config",
                 f"set {key} to a value DeepSpeed accepts ({msg[:1].lower() + msg[1:]}), or remove it for the "
                 f"default")


def deepspeed_checks(cfg: dict) -> list[Check]:
    """DeepSpeed's own validation of ``zero_optimization``, one FAIL per bad key naming it and the fix (never a
    traceback: ``fcdp doctor`` is where a user finds out what ``deepspeed.initialize`` would refuse)."""
    try:
        from deepspeed.runtime.zero.config import get_zero_config
        from pydantic import ValidationError
        get_zero_config(dict(cfg))
    except ValidationError as err:
        return [_zero_problem(e) for e in err.errors()]
    except Exception as err:  # [Note: doctor reports, never crashes: whatever DeepSpeed raises is the finding]
        return [Check("deepspeed", "FAIL", f"zero_optimization: DeepSpeed refuses it: {type(err).__name__}: {err}",
                      "fix the zero_optimization block as the message says")]
    return []


def _fail(area: str, message: str) -> Check:
    return Check(area, "FAIL", message.split(" Fix: ")[0], message.split(" Fix: ", 1)[1] if " Fix: " in message else "")


def block_checks(cfg: dict) -> list[Check]:
    """Every problem of the block at once, each once: placement, each bad key, the DeepSpeed settings it cannot
    run with (also for a config without a block: whether adding one would be refused)."""
    from fcdp_deepspeed.config import (FCDPConfigError, check_ds_config_compatible, grad_path_blockers,
                                       parse_fcdp_config, placement_problems)
    from fcdp_deepspeed.config.errors import near_fcdp
    out = [_fail("block", p) for p in placement_problems(cfg)]
    if "fcdp" not in cfg:  # a misplaced or misspelled block: check what it says as if it sat where it belongs
        zero = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
        stray = [v for k, v in list(cfg.items()) + list(zero.items()) if near_fcdp(k)]
        if stray:
            cfg = {**cfg, "fcdp": stray[0],
                   "zero_optimization": {k: v for k, v in zero.items() if not near_fcdp(k)}}
    raw = cfg.get("fcdp")
    try:
        enabled = parse_fcdp_config(cfg).enabled
    except FCDPConfigError as err:
        out += [_fail("block", p) for p in err.problems]
        enabled = None
    deepspeed = deepspeed_checks(cfg)
    out += deepspeed
    meant = raw is True or isinstance(raw, dict) and raw.get("enabled") is True
    if enabled is False:
        out.append(Check("block", "WARN", "no enabled \"fcdp\" block: this config runs DeepSpeed without FCDP",
                         "add \"fcdp\": {\"enabled\": true} at the top level"))
    if deepspeed or (enabled is None and not meant):
        return out
    if enabled:
        out.append(Check("block", "ok", "the \"fcdp\" block is valid and enabled"))
    # [Note: with the block invalid (already listed above) or absent, check the rest with a minimal enabled
    # block, so each block error is reported once and a stage-2 config says that a block would be refused.]
    probe = cfg if enabled else {**cfg, "fcdp": {"enabled": True}}
    try:
        check_ds_config_compatible(probe)
    except FCDPConfigError as err:
        found = _fail("block", str(err))
        if enabled is False:
            found.message = f"adding an \"fcdp\" block would be refused: {found.message}"
            found.fix = found.fix.replace(' or set "fcdp": {"enabled": false}', " before adding the block")
        return out + [found]
    if enabled is not False:
        out += [Check("block", "WARN", f"gradient modes fall back to DeepSpeed's path: {b.split(' Fix: ')[0]}",
                      b.split(" Fix: ")[-1]) for b in grad_path_blockers(cfg)]
    return out


def resolved_plan(cfg: dict, nodes: int, ranks_per_node: int) -> dict:
    """What an engine would run with this block on N nodes x L ranks: the functions engines use."""
    from fcdp_deepspeed.config import grad_accumulation_blockers, grad_path_blockers, parse_fcdp_config
    from fcdp_deepspeed.engine.announce import compression_words
    from fcdp_deepspeed.grads.plan import resolve_grad_plan
    from fcdp_deepspeed.reporting.stats import fmt_bytes, plural
    from fcdp_deepspeed.runtime.allocation import host_budget_per_node
    from fcdp_deepspeed.storage import memory

    block = parse_fcdp_config(cfg)
    layout = f"{plural(nodes, 'node')} x {plural(ranks_per_node, 'rank')} per node"
    if block.diloco is not None:  # the engine's own words (announce.diloco_line): no cache, nothing cross-node
        from fcdp_deepspeed.engine.announce import DILOCO_NO_CACHE, diloco_words
        return {"layout": layout, "mode": f"LOSSY DiLoCo across {plural(nodes, 'node')}: {diloco_words(block.diloco)}",
                "cache": DILOCO_NO_CACHE, "param_gather": "inside each node only (ZeRO-3 over the node's ranks)",
                "grad_reduce": "inside each node only; the nodes exchange pseudo-gradients at each outer sync",
                "compression": f"LOSSY (DiLoCo), pseudo-gradients fcdp.diloco.compression {block.diloco.compression}"}
    ga = cfg.get("gradient_accumulation_steps")
    ga = ga if isinstance(ga, int) and not isinstance(ga, bool) and ga >= 1 else 1
    grads = resolve_grad_plan(block.grad_reduce, block.grad_accumulation, nodes, ranks_per_node, ga,
                              grad_path_blockers(cfg), grad_accumulation_blockers(cfg))
    accumulation = f"{grads.grad_accumulation} ({grads.accumulation_reason})"
    if "buffer not measured" in grads.accumulation_reason:
        accumulation = ("node if the buffer (1/L of the trainable parameters per rank, fp32) fits "
                        f"fcdp.grad_buffer_budget {block.grad_buffer_budget!r} when the engine is built, else rank")
    limit = memory.host_limit()
    host_node, _ = host_budget_per_node(block.host_budget_spec, limit)
    cache = ("none: one node, nothing to save across nodes" if nodes == 1 else
             f"cache_device {block.cache_device}, host budget {fmt_bytes(host_node)} per node on this machine "
             f"({block.host_budget!r} of {limit.describe()}), {fmt_bytes(host_node // ranks_per_node)} per rank")
    out = {"layout": layout}
    if nodes > 1 and ranks_per_node > 1 and not block.paths_asked():
        out["paths"] = ({"probe": "chosen when the engine is built, from a probe of the links (fcdp.link): FCDP's "
                                  "as below where the inter-node link is the bottleneck, else ZeRO-3's (nothing cached, "
                                  "every path flat); fcdp plan predicts the choice for a described cluster",
                         "slow": "FCDP's (fcdp.link slow), as below",
                         "fast": "ZeRO-3's (fcdp.link fast): nothing cached, every path flat"}[block.link])
        if block.link == "fast":
            return {**out, "compression": compression_words(block)}
    return {**out, "cache": cache,
            "param_gather": block.resolved_param_gather(nodes, ranks_per_node),
            "grad_reduce": f"{grads.grad_reduce} ({grads.reduce_reason})", "grad_accumulation": accumulation,
            "compression": compression_words(block)}


def run(config: Optional[str], nodes: Optional[int], ranks_per_node: Optional[int]) -> tuple[list[Check], dict]:
    results = installation_checks()
    plan: dict = {}
    if config:
        try:
            more, cfg = config_checks(config)
        except Exception as err:  # [Note: doctor reports, never crashes: an unforeseen error is a finding too]
            more, cfg = [Check("config", "FAIL", f"{config}: checking it raised {type(err).__name__}: {err}",
                               "fix what the message names; please report it if the config is valid")], None
        results += more
        block = (cfg or {}).get("fcdp") if isinstance((cfg or {}).get("fcdp"), dict) else {}
        L = ranks_per_node or block.get("ranks_per_node")
        if cfg is not None and not any(c.status == "FAIL" and c.area in ("config", "block", "deepspeed")
                                       for c in results):
            if nodes and isinstance(L, int) and L >= 1:
                try:
                    plan = resolved_plan(cfg, nodes, L)
                except Exception as err:  # [Note: doctor reports, never crashes]
                    results.append(Check("plan", "FAIL", f"resolving the plan for {nodes} x {L} raised "
                                         f"{type(err).__name__}: {err}", "fix what the message names; please report "
                                         "it if the config is valid"))
            else:
                results.append(Check("plan", "WARN", "no layout given: the plan is not shown",
                                     "add --nodes N --ranks-per-node L (the job's layout)"))
    return results, plan


def main(argv: Optional[list[str]] = None) -> int:
    ap = checks.parser("fcdp doctor", __doc__)
    ap.add_argument("config", nargs="?", help="a DeepSpeed config (JSON/HJSON) to check")
    ap.add_argument("--config", dest="config_option", metavar="CONFIG",
                    help="the same, as `fcdp plan --config` takes it")
    ap.add_argument("--nodes", type=checks.whole(1), help="N, nodes of the job (for the plan)")
    ap.add_argument("--ranks-per-node", type=checks.whole(1), help="L, ranks per node (default: the block's "
                                                                    "ranks_per_node)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    if args.config and args.config_option and args.config != args.config_option:
        ap.error(f"two configs given ({args.config} and --config {args.config_option}): give one")
    args.config = args.config or args.config_option
    results, plan = run(args.config, args.nodes, args.ranks_per_node)
    failed = sum(c.status == "FAIL" for c in results)
    warned = sum(c.status == "WARN" for c in results)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in results], "plan": plan, "failed": failed}, indent=1))
        return 1 if failed else 0
    for c in results:
        print(f"{c.status:<5} {c.area:<8} {c.message}" + (f"\n{'':<15}fix: {c.fix}" if c.fix and c.status != "ok" else ""))
    if plan:
        print(f"\nplan for {plan.pop('layout')}:")
        for key, value in plan.items():
            print(f"  {key:<17} {value}")
    off = any(c.status == "WARN" and "no enabled" in c.message for c in results)
    verdict = "" if failed or not args.config else (": FCDP can run here once the block is enabled" if off
                                                     else ": FCDP can run here with this config")
    print(f"\n{failed} failed, {warned} {'warning' if warned == 1 else 'warnings'}{verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
