"""Demonstrated power: deliberate bugs in a copy of tinylm, each of which the suite must catch.

``python -m props.mutate`` (or ``tinylm props --mutate``) copies ``tinylm`` and
``props`` to a temporary directory per mutant, applies one patch to the copy's
source text (the installed tinylm is never touched), and runs the property suite
there in a subprocess (``OMP_NUM_THREADS=1``, that directory first on the path),
several mutants at a time. A mutant is *killed* when at least one property fails;
the report names every property that failed. An unpatched copy runs first as
the baseline: it must pass, or no kill would mean anything.

These patches are realistic semantic bugs (a missing max shift, a mean over the
wrong axis, a gate on the wrong projection, pre-norm wired as post-norm) that an
operator-level mutation tool does not generate: none of them is among the mutants
mutmut makes of the same files. The operator-level score of the suite is measured
by ``benchmarks/mutation.py`` (mutmut 3); see ``docs/mutation.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from tinylm.errors import TinyLMError

from .runner import PROPS_DIR, SuiteRun, run_suite

__all__ = ["Mutant", "MUTANTS", "MutantResult", "MutationReport", "MutantError", "apply", "run_mutant", "run_all", "main"]


class MutantError(TinyLMError):
    """A mutant's patch does not apply (its source text is not found exactly once)."""


@dataclass(frozen=True)
class Mutant:
    """One deliberate bug: replace ``old`` by ``new`` (each exactly once) in ``tinylm/<file>``."""

    name: str
    file: str
    old: str
    new: str
    bug: str


MUTANTS: tuple[Mutant, ...] = (
    Mutant("softmax-no-max-shift", "functional.py",
           "y = x - x.amax(dim=dim, keepdim=True)", "y = x.clone()",
           "softmax without the max shift (overflows at large logits)"),
    Mutant("log-of-softmax", "functional.py",
           "return (xc - logsumexp(xc, dim=dim, keepdim=True)).to(x.dtype)", "return torch.log(softmax(x, dim=dim))",
           "log_softmax computed as log(softmax(x))"),
    Mutant("logsumexp-no-shift", "functional.py",
           "m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))", "m = torch.zeros_like(m)",
           "logsumexp without the max shift"),
    Mutant("rmsnorm-eps-outside-sqrt", "functional.py",
           "inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)",
           "inv_rms = 1 / (torch.sqrt(xf.pow(2).mean(dim=-1, keepdim=True)) + eps)",
           "RMSNorm with eps outside the square root"),
    Mutant("rmsnorm-no-upcast", "functional.py",
           "xf = x.to(torch.promote_types(in_dtype, torch.float32))", "xf = x",
           "RMSNorm computed in the input dtype (no float32 upcast)"),
    Mutant("rmsnorm-wrong-axis", "functional.py",
           "inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)",
           "inv_rms = torch.rsqrt(xf.pow(2).mean(dim=0, keepdim=True) + eps)",
           "RMSNorm mean over the wrong axis"),
    Mutant("rmsnorm-no-gain", "functional.py",
           "out = out * weight.to(out.dtype)", "out = out",
           "RMSNorm ignores its gain"),
    Mutant("ce-target-off-by-one", "functional.py",
           "z_target = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)",
           "z_target = logits.gather(-1, (targets.unsqueeze(-1) + 1) % logits.shape[-1]).squeeze(-1)",
           "cross-entropy at target + 1"),
    Mutant("ce-grad-target-off-by-one", "functional.py",
           "grad.scatter_add_(-1, targets.unsqueeze(-1), minus_y)",
           "grad.scatter_add_(-1, (targets.unsqueeze(-1) + 1) % C, minus_y)",
           "cross-entropy gradient p - y with y at target + 1"),
    Mutant("ce-grad-p-not-p-minus-y", "functional.py",
           "grad.scatter_add_(-1, targets.unsqueeze(-1), minus_y)  # p - q", "pass",
           "cross-entropy gradient p instead of p - y"),
    Mutant("label-smoothing-c-minus-1", "functional.py",
           "uniform = lse - logits.mean(dim=-1)  # -(1/C) sum_c log p_c",
           "uniform = lse - (logits.sum(dim=-1) - z_target) / (logits.shape[-1] - 1)",
           "label smoothing spreads eps/(C-1) over the non-targets"),
    Mutant("ce-sum-not-mean", "functional.py", "            loss = nll.mean()\n", "            loss = nll.sum()\n",
           "cross-entropy summed instead of averaged"),
    Mutant("silu-sigmoid-approx", "functional.py",
           "return x * torch.sigmoid(x)", "return x * torch.sigmoid(1.702 * x)",
           "SiLU replaced by the sigmoid GELU approximation"),
    Mutant("dropout-no-rescale", "functional.py",
           "return x * keep.to(x.dtype) / (1.0 - p)", "return x * keep.to(x.dtype)",
           "dropout without the 1/(1-p) rescale"),
    Mutant("dropout-keep-p", "functional.py",
           "keep = torch.rand(x.shape, generator=generator, device=x.device) >= p",
           "keep = torch.rand(x.shape, generator=generator, device=x.device) < p",
           "dropout keeps with probability p instead of 1-p"),
    Mutant("causal-mask-off-by-one", "functional.py",
           "return idx[:, None] >= idx[None, :]", "return idx[:, None] + 1 >= idx[None, :]",
           "causal mask lets each query see the next token"),
    Mutant("attention-scale-1-over-dk", "functional.py",
           "scores = (Q / math.sqrt(d_k)) @ K.transpose(-2, -1)",
           "scores = (Q / d_k) @ K.transpose(-2, -1)",
           "attention scaled by 1/d_k instead of 1/sqrt(d_k)"),
    Mutant("attention-mask-fill-zero", "functional.py",
           'scores = scores.masked_fill_(~mask, float("-inf"))', "scores = scores.masked_fill_(~mask, 0.0)",
           "masked scores set to 0 instead of -inf"),
    Mutant("rope-frequency-k-over-dk", "functional.py",
           "inv_freq = theta ** (-torch.arange(0, d_k, 2, dtype=torch.float64) / d_k)",
           "inv_freq = theta ** (-torch.arange(0, d_k // 2, dtype=torch.float64) / d_k)",
           "RoPE frequency theta^(-k/d_k) instead of theta^(-2k/d_k)"),
    Mutant("rope-rotate-halves", "functional.py",
           "pairs = x.unflatten(-1, (-1, 2))",
           "pairs = x.unflatten(-1, (2, -1)).transpose(-1, -2)",
           "RoPE pairs (x_k, x_k+d/2) instead of adjacent (x_2k, x_2k+1)"),
    Mutant("truncnorm-variance-uncorrected", "init.py",
           "return sigma**2 * (1 + (a_pa - b_pb) / z - ((pa - pb) / z) ** 2)", "return sigma**2",
           "truncated-normal variance reported as sigma^2"),
    Mutant("truncation-at-2-sigma", "init.py",
           'return Dist("trunc_normal", std=std, low=-3 * std, high=3 * std, why=why)',
           'return Dist("trunc_normal", std=std, low=-2 * std, high=2 * std, why=why)',
           "Linear init truncated at 2 sigma instead of 3"),
    Mutant("xavier-d-out", "init.py",
           "std = math.sqrt(2.0 / (site.fan_in + site.fan_out))", "std = math.sqrt(2.0 / site.fan_out)",
           "Xavier with d_out in place of d_in + d_out"),
    Mutant("kaiming-fan-out", "init.py",
           "return _trunc3(math.sqrt(2.0 / site.fan_in),", "return _trunc3(math.sqrt(2.0 / site.fan_out),",
           "Kaiming with fan_out in place of fan_in"),
    Mutant("gpt2-residual-sqrt-L", "init.py",
           "std=0.02 / math.sqrt(2 * site.num_layers)", "std=0.02 / math.sqrt(site.num_layers)",
           "GPT-2 residual scaling 1/sqrt(L) instead of 1/sqrt(2L)"),
    Mutant("swiglu-gate-swapped", "layers.py",
           "return self.w2(self.hidden(F.silu(self.w1(x)) * self.w3(x)))",
           "return self.w2(self.hidden(self.w1(x) * F.silu(self.w3(x))))",
           "SwiGLU gate and value swapped (silu on the w3 branch)"),
    Mutant("mha-heads-interleaved", "layers.py",
           'split = "... t (h d) -> ... h t d"', 'split = "... t (d h) -> ... h t d"',
           "attention heads taken interleaved instead of stacked"),
    Mutant("residual-dropped", "model.py",
           "h = self.resid_mid(x + self._branch(self.attn, self.ln1(x), token_positions))",
           "h = self.resid_mid(self._branch(self.attn, self.ln1(x), token_positions))",
           "pre-norm block drops the attention residual"),
    Mutant("pre-norm-as-post-norm", "model.py",
           "h = self.resid_mid(x + self._branch(self.attn, self.ln1(x), token_positions))\n            return h + self._branch(self.ffn, self.ln2(h))",
           "h = self.resid_mid(self.ln1(x + self._branch(self.attn, x, token_positions)))\n            return self.ln2(h + self._branch(self.ffn, h))",
           "pre-norm block computes post-norm"),
    Mutant("tied-embeddings-split", "model.py",
           "self.to_empty(device=device)\n        if self.config.tie_embeddings:\n            self.lm_head.weight = self.token_embeddings.weight",
           "self.to_empty(device=device)\n        if self.config.tie_embeddings:\n            pass",
           "tied embeddings not re-tied after to_empty (lm_head gets its own matrix)"),
    Mutant("layernorm-no-centering", "functional.py",
           "centered = xf - xf.mean(dim=-1, keepdim=True)", "centered = xf",
           "LayerNorm without mean removal"),
    Mutant("layernorm-unbiased-var", "functional.py",
           "y = centered / torch.sqrt(centered.pow(2).mean(dim=-1, keepdim=True) + eps)",
           "y = centered / torch.sqrt(centered.var(dim=-1, keepdim=True) + eps)",
           "LayerNorm with the unbiased variance (divides by d - 1)"),
    Mutant("layernorm-bias-ignored", "layers.py",
           "return F.layer_norm(x, self.weight, self.bias, self.eps)", "return F.layer_norm(x, self.weight, None, self.eps)",
           "LayerNorm module never adds its bias"),
    Mutant("gelu-erf-unscaled", "functional.py",
           "torch.erf(x / math.sqrt(2.0))", "torch.erf(x)",
           "exact GELU with erf(x) for erf(x/sqrt 2)"),
    Mutant("gelu-tanh-cubic", "functional.py",
           "0.044715 * x.pow(3)", "0.44715 * x.pow(3)",
           "tanh GELU with the cubic coefficient a decimal off"),
    Mutant("relu-leaky", "functional.py",
           "torch.where(x <= 0, torch.zeros_like(x), x)", "torch.where(x <= 0, 0.01 * x, x)",
           "ReLU that leaks negative inputs"),
    Mutant("learned-positions-ignore-token-positions", "model.py",
           "self.position_embeddings(self._positions(T, token_positions, token_ids.device))",
           "self.position_embeddings(torch.arange(T, device=token_ids.device))",
           "learned position table read at 0..T-1 whatever token_positions say"),
)


@dataclass
class MutantResult:
    """What the suite did to one mutant."""

    mutant: Mutant
    killed: bool
    killers: list[str]
    seconds: float
    error: str = ""
    run: SuiteRun | None = None

    @property
    def status(self) -> str:
        """killed / SURVIVED / error; for the baseline (no mutation): passes / FAILS / error."""
        if self.error:
            return "error"
        if self.mutant is BASELINE:
            return "FAILS" if self.killed else "passes"
        return "killed" if self.killed else "SURVIVED"


@dataclass
class MutationReport:
    """The baseline run and every mutant's result; renders itself as a rich table."""

    baseline: MutantResult | None
    results: list[MutantResult] = field(default_factory=list)
    seconds: float = 0.0
    workers: int = 1

    @property
    def all_killed(self) -> bool:
        baseline_ok = self.baseline is None or (not self.baseline.killed and not self.baseline.error)
        return baseline_ok and bool(self.results) and all(r.killed and not r.error for r in self.results)

    def __rich__(self):
        from rich.table import Table

        killed = sum(r.killed and not r.error for r in self.results)
        t = Table(
            title=f"Mutation check: {killed}/{len(self.results)} mutants killed "
            f"in {self.seconds:.0f} s ({self.workers} workers, OMP_NUM_THREADS=1)",
            title_justify="left",
        )
        t.add_column("mutant", no_wrap=True)
        t.add_column("bug")
        t.add_column("result", no_wrap=True)
        t.add_column("killed by (failing properties)")
        t.add_column("s", justify="right")
        rows = ([self.baseline] if self.baseline is not None else []) + self.results
        for r in rows:
            status = r.status
            style = "green" if status in ("killed", "passes") else "red"
            by = r.error or (", ".join(r.killers[:6]) + (f" (+{len(r.killers) - 6})" if len(r.killers) > 6 else ""))
            t.add_row(r.mutant.name, r.mutant.bug, f"[{style}]{status}[/]", by or "-", f"{r.seconds:.0f}")
        return t


    def to_markdown(self) -> str:
        """The same table as GitHub markdown (as in docs/props.md), every failing property listed."""
        killed = sum(r.killed and not r.error for r in self.results)
        lines = [
            f"{killed}/{len(self.results)} mutants killed in {self.seconds:.0f} s "
            f"({self.workers} workers, OMP_NUM_THREADS=1).",
            "",
            "| mutant | bug | result | killed by (every failing property) | s |",
            "| --- | --- | --- | --- | ---: |",
        ]
        rows = ([self.baseline] if self.baseline is not None else []) + self.results
        for r in rows:
            status = r.status
            by = r.error or ", ".join(f"`{k}`" for k in r.killers) or "-"
            lines.append(f"| `{r.mutant.name}` | {r.mutant.bug} | {status} | {by} | {r.seconds:.0f} |")
        return "\n".join(lines) + "\n"


BASELINE = Mutant("baseline (no mutation)", "", "", "", "the unmodified copy: every property must pass")


def _tinylm_dir() -> Path:
    import tinylm

    return Path(tinylm.__file__).resolve().parent


def apply(mutant: Mutant, dest: str | os.PathLike) -> Path:
    """Copy tinylm and props into ``dest`` and apply ``mutant`` to the copy; returns ``dest``.

    Raises MutantError when the patch's source text is not found exactly once.
    """
    dest = Path(dest)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(_tinylm_dir(), dest / "tinylm", ignore=ignore, dirs_exist_ok=True)
    shutil.copytree(PROPS_DIR, dest / "props", ignore=ignore, dirs_exist_ok=True)
    # a root of its own: no repository conftest or pyproject is picked up
    (dest / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    if mutant.file:
        path = dest / "tinylm" / mutant.file
        src = path.read_text()
        n = src.count(mutant.old)
        if n != 1:
            raise MutantError(f"mutant {mutant.name!r}: its source text occurs {n} times in tinylm/{mutant.file} (need 1)")
        path.write_text(src.replace(mutant.old, mutant.new))
    return dest


def run_mutant(mutant: Mutant, *, select: str | None = None, first_failure: bool = False, timeout: float = 900) -> MutantResult:
    """Apply ``mutant`` in a fresh temporary directory and run the suite on it."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tinylm-mutant-") as tmp:
        try:
            apply(mutant, tmp)
        except MutantError as e:
            return MutantResult(mutant, False, [], time.perf_counter() - t0, error=str(e))
        env = dict(os.environ)
        env["PYTHONPATH"] = tmp + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["OMP_NUM_THREADS"] = "1"
        env.pop("TINYLM_PROPS_IMPL", None)
        env.setdefault("HYPOTHESIS_PROFILE", "ci")
        env["TINYLM_PROPS_NO_SHRINK"] = "1"
        run = run_suite(
            props_dir=Path(tmp) / "props",
            cwd=tmp,
            env=env,
            select=select,
            extra_args=["-c", str(Path(tmp) / "pytest.ini"), "--rootdir", tmp] + (["-x"] if first_failure else []),
            timeout=timeout,
        )
        seconds = time.perf_counter() - t0
        if run.tinylm_file and not str(Path(run.tinylm_file).resolve()).startswith(str(Path(tmp).resolve())):
            return MutantResult(mutant, False, [], seconds, error=f"suite imported {run.tinylm_file}, not the copy", run=run)
        killers = [r.name for r in run.failed]
        if not run.results:  # nothing collected: an import error (a crash counts as a kill, but say so)
            if run.returncode == 0:
                return MutantResult(mutant, False, [], seconds, error="no property ran", run=run)
            return MutantResult(mutant, True, ["(collection error: " + run.output_tail.splitlines()[-1][:80] + ")"], seconds, run=run)
        return MutantResult(mutant, bool(killers) or run.returncode not in (0, 5), killers, seconds, run=run)


def run_all(
    mutants: Iterable[Mutant] = MUTANTS,
    *,
    workers: int = 2,
    baseline: bool = True,
    select: str | None = None,
    first_failure: bool = False,
    on_result: Callable[[MutantResult], None] | None = None,
) -> MutationReport:
    """Run the baseline and every mutant, ``workers`` suites at a time."""
    mutants = list(mutants)
    t0 = time.perf_counter()
    jobs = ([BASELINE] if baseline else []) + mutants
    results: dict[str, MutantResult] = {}

    def one(m: Mutant) -> MutantResult:
        r = run_mutant(m, select=select, first_failure=first_failure and m is not BASELINE)
        if on_result is not None:
            on_result(r)
        return r

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for r in pool.map(one, jobs):
            results[r.mutant.name] = r
    return MutationReport(
        baseline=results.get(BASELINE.name),
        results=[results[m.name] for m in mutants],
        seconds=time.perf_counter() - t0,
        workers=max(1, workers),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="suites run at once (default: CPU count)")
    p.add_argument("--only", action="append", metavar="NAME", help="run only this mutant (repeatable)")
    p.add_argument("--first-failure", action="store_true", help="stop each mutant's run at its first failing property")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as markdown to PATH")


def select_mutants(only: list[str] | None) -> list[Mutant]:
    """The mutants named in ``only`` (all when None); unknown names raise MutantError naming the known ones."""
    if not only:
        return list(MUTANTS)
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in only if n not in known]
    if unknown:
        raise MutantError(f"unknown mutant(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in only]


def main(argv: list[str] | None = None) -> int:
    """``python -m props.mutate``: run every mutant and print the table; exit 1 if any survived."""
    from rich.console import Console

    parser = argparse.ArgumentParser(prog="python -m props.mutate", description=__doc__.strip().splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    console = Console()
    if args.list:
        for m in MUTANTS:
            console.print(f"{m.name:32s} tinylm/{m.file:14s} {m.bug}")
        return 0
    try:
        mutants = select_mutants(args.only)
    except MutantError as e:
        print(f"props.mutate: error: {e}", file=sys.stderr)
        return 2
    report = run_all(
        mutants,
        workers=args.workers,
        first_failure=args.first_failure,
        on_result=lambda r: console.print(f"  {r.mutant.name}: {r.status} ({r.seconds:.0f} s)", highlight=False),
    )
    console.print(report)
    if args.markdown:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        Path(args.markdown).write_text(report.to_markdown() + f"\nLoad average (1, 5, 15 min) at the end of the run: {load}.\n")
    return 0 if report.all_killed else 1


if __name__ == "__main__":
    sys.exit(main())
