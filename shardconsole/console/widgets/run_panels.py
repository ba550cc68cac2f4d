"""The run screen's panels. Each takes the RunView and draws itself: the screen owns the data.

Memory has two views and both are labelled: what NVML says a GPU uses, and what each rank's
allocator holds (reserved / peak). "Not applicable" reads n/a, never 0.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static

from shardconsole.machine import offload_verdict
from shardconsole.runlog.runstate import fmt_rate, preference_text, reward_text
from shardconsole.console.runview import GIB, SYNTHETIC, RunView, count
from shardconsole.console.widgets.line_plot import LinePlot, PlotSeries

# Hex colours: the plots draw with Rich styles and the legends with Textual markup, which share these.
HOST_COLOR = "#5fafff"
GPU_COLOR = "#87d75f"
TOKENS_COLOR = "#d787ff"
LOSS_COLOR = "#5fd7d7"
EVAL_COLOR = "#ffaf5f"


def gib(n: int | float | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.1f}"


def bar(used: float, total: float, width: int) -> Text:
    """A used/total bar; its colour warns as the card fills (OOM is what this tool is about)."""
    frac = 0.0 if total <= 0 else max(0.0, min(1.0, used / total))
    filled = round(frac * width)
    color = "green" if frac < 0.8 else "yellow" if frac < 0.95 else "red"
    return Text.assemble(("█" * filled, color), ("░" * (width - filled), "bright_black"))


def duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def pack(items: list[Text], width: int, sep: str = " · ") -> Text:
    """Items joined with sep, a new line where the next would not fit: a narrow panel (80 columns)
    wraps between items instead of cutting the last ones off."""
    out = Text(no_wrap=True, overflow="ellipsis")
    used = 0
    for item in items:
        if used and used + len(sep) + item.cell_len > width:
            out.append("\n")
            used = 0
        elif used:
            out.append(sep)
            used += len(sep)
        out.append_text(item)
        used += item.cell_len
    return out


class Panel(Vertical):
    """A bordered panel with a title; its body is laid out by run.tcss."""

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="panel")
        self.border_title = title


class GpuPanel(VerticalScroll, can_focus=False):
    """Scrolls when a node has more GPUs than fit (8 GPUs on an 80x24 terminal)."""

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="panel")
        self.border_title = title

    def compose(self) -> ComposeResult:
        yield Static("waiting for the first sample", id="gpu-text", markup=False)
        # The fullest card's memory over time: its own chart and axis (GiB), not on the host's.
        yield LinePlot(id="gpu-plot", empty="", fmt=lambda v: f"{v:.1f} GiB", y_min=0.0)

    def show(self, view: RunView, gpu_unavailable: str) -> None:
        state = view.state
        text = Text(no_wrap=True, overflow="ellipsis")
        width = max(20, self.content_region.width or self.size.width - 2)
        on_gpu, elsewhere = view.ranks_by_gpu()
        if not state.gpus:
            if gpu_unavailable:
                text.append("No GPU: ", "bold")
                text.append(f"{gpu_unavailable}.\n", "")
            else:
                text.append("No GPU sample yet.\n", "dim")
        names = {g.name for g in state.gpus.values()}
        self.border_title = "GPUs" + (f" · {len(state.gpus)}× {names.pop()}" if len(names) == 1 else "")
        bar_w = max(4, min(24, width - 26))
        for idx in sorted(state.gpus):
            g = state.gpus[idx]
            util = "  n/a" if g.util_pct is None else f"{g.util_pct:4.0f}%"
            text.append(f"gpu{idx} ")
            text.append_text(bar(g.used_bytes, g.total_bytes, bar_w))
            text.append(f" {gib(g.used_bytes)}/{gib(g.total_bytes)} GiB {util}\n")
            vitals = fit_vitals(g, width - 2)
            if vitals:
                text.append("  " + vitals + "\n", "dim")
            if g.throttle:
                text.append("  throttled: " + ", ".join(g.throttle) + "\n", "bold red")
            for line in _rank_lines(view, on_gpu.get(idx, [])):
                text.append("  " + line + "\n", "bright_black" if "n/a" in line else "")
        if view.planned_gpu_bytes:
            peak = max((m.peak_reserved_bytes or 0 for m in state.memory.values()), default=0)
            measured = f" · measured allocator peak {gib(peak)} GiB" if peak else ""
            text.append(f"planned peak {gib(view.planned_gpu_bytes)} GiB a GPU{measured}\n", "dim")
        for line, style in offload_view(view):
            text.append(line + "\n", style)
        if elsewhere:
            devices = {h.device.split(":")[0] for r, h in state.hellos.items() if r in elsewhere}
            where = "on cpu" if devices == {"cpu"} else "not on this machine's GPUs"
            text.append(f"{len(elsewhere)} rank(s) {where}", "bold")
            if devices == {"cpu"}:
                text.append(": their memory is under Host RAM\n")
            else:
                text.append("\n")
                for line in _rank_lines(view, elsewhere):
                    text.append("  " + line + "\n")
        text.rstrip()
        self.query_one("#gpu-text", Static).update(text)
        plot = self.query_one("#gpu-plot", LinePlot)
        plot.set_class(not len(view.gpu_used_gib), "-empty")
        plot.series = (PlotSeries("fullest GPU", view.gpu_used_gib.xs, view.gpu_used_gib.ys, GPU_COLOR),)
        charted = len(view.gpu_used_gib) and self.screen.has_class("-wide")     # run.tcss: not at 80 columns
        self.border_subtitle = f"[{GPU_COLOR}]fullest GPU used, GiB[/]" if charted else ""


def gpu_vitals(g) -> str:
    """'63°C · 310/700 W · SM 1980/1980 MHz · PCIe ↓12.3 ↑0.4 GB/s · throttled: sw_power_cap' (NVML, ~1 Hz);
    a value the card does not report is left out."""
    parts = []
    if g.temp_c is not None:
        parts.append(f"{g.temp_c:.0f}°C")
    if g.power_w is not None:
        parts.append(f"{g.power_w:.0f}" + (f"/{g.power_limit_w:.0f}" if g.power_limit_w else "") + " W")
    if g.sm_clock_mhz is not None:
        parts.append(f"SM {g.sm_clock_mhz:.0f}" + (f"/{g.sm_clock_max_mhz:.0f}" if g.sm_clock_max_mhz else "") + " MHz")
    if g.pcie_rx_bps is not None or g.pcie_tx_bps is not None:
        parts.append(f"PCIe ↓{(g.pcie_rx_bps or 0) / 1e9:.1f} ↑{(g.pcie_tx_bps or 0) / 1e9:.1f} GB/s")
    if g.throttle:
        parts.append("throttled: " + ", ".join(g.throttle))
    return " · ".join(parts)


def fit_vitals(g, width: int) -> str:
    """The vitals without the throttle reasons (a line of their own) in one line of `width`: the
    separators and the clock's maximum go first, then the quantities from the end (PCIe, clock)."""
    parts = []
    if g.temp_c is not None:
        parts.append(f"{g.temp_c:.0f}°C")
    if g.power_w is not None:
        parts.append(f"{g.power_w:.0f}" + (f"/{g.power_limit_w:.0f}" if g.power_limit_w else "") + " W")
    clock = None
    if g.sm_clock_mhz is not None:
        clock = len(parts)
        parts.append(f"SM {g.sm_clock_mhz:.0f}" + (f"/{g.sm_clock_max_mhz:.0f}" if g.sm_clock_max_mhz else "") + " MHz")
    if g.pcie_rx_bps is not None or g.pcie_tx_bps is not None:
        parts.append(f"PCIe ↓{(g.pcie_rx_bps or 0) / 1e9:.1f} ↑{(g.pcie_tx_bps or 0) / 1e9:.1f} GB/s")
    for sep in (" · ", "  "):
        if len(sep.join(parts)) <= width:
            return sep.join(parts)
    if clock is not None:
        parts[clock] = f"SM {g.sm_clock_mhz:.0f} MHz"
    while parts and len("  ".join(parts)) > width:
        parts.pop()
    return "  ".join(parts)


def offload_view(view: RunView) -> list[tuple[str, str]]:
    """The offload view (offloaded runs): the slowest rank's phase times at the last log step, its card's
    PCIe rates and pinned bytes, and the verdict with the setting to try."""
    state = view.state
    if not state.offload:
        return []
    o = max(state.offload.values(), key=lambda m: (m.step, m.step_s))

    def s(x):
        return "n/a" if x is None else f"{x:.3g} s"
    rows = [(f"offload · rank {o.rank}, mean of {o.steps} step(s) to {o.step}" +
             ("" if o.clock == "cuda_events" else " (wall clock: CPU ranks)"), "bold"),
            (f"  GPU {s(o.gpu_s)} · host step {s(o.host_step_s)} · H2D {s(o.h2d_s)} · D2H {s(o.d2h_s)} "
             f"of {o.step_s:.3g} s", "")]
    extra = []
    pcie = offload_verdict.pcie_of(o, state.gpu_of(o.rank))
    if pcie is not None:
        extra.append(offload_verdict.pcie_text(pcie))
    if o.pinned_bytes:
        extra.append(f"pinned {gib(o.pinned_bytes)} GiB")
    if extra:
        rows.append(("  " + " · ".join(extra), "dim"))
    overlap = offload_verdict.overlap_text(o.overlap, o.gpu_s, o.host_step_s, o.h2d_s, o.d2h_s, o.step_s,
                                           o.host_hidden_s)
    if overlap:
        rows.append((f"  {overlap}", "dim"))
    if o.verdict:
        rows.append((f"  {o.verdict}" + (f": try {o.hint}" if o.hint else ""), "bold yellow"))
    return rows


def _rank_lines(view: RunView, ranks: list[int], limit: int = 4) -> list[str]:
    """Each rank's allocator: reserved now / peak reserved; many ranks fold into one summary line."""
    mem = [view.state.memory[r] for r in ranks if r in view.state.memory]
    if not mem:
        return []
    if all(m.reserved_bytes is None for m in mem):
        return []   # CPU ranks: no allocator figures; their RSS is in the host panel
    if len(mem) > limit:
        res = [m.reserved_bytes or 0 for m in mem]
        peak = max(m.peak_reserved_bytes or 0 for m in mem)
        return [f"{len(mem)} ranks: reserved {gib(min(res))}-{gib(max(res))} GiB, peak max {gib(peak)} GiB"]
    return [f"r{m.rank} reserved {gib(m.reserved_bytes)} · peak {gib(m.peak_reserved_bytes)} GiB" for m in mem]


class HostPanel(Panel):
    def compose(self) -> ComposeResult:
        yield Static("waiting for the first sample", id="host-text", markup=False)
        yield LinePlot(id="memory-plot", empty="host RAM over time: waiting for samples",
                       fmt=lambda v: f"{v:.1f} GiB", y_min=0.0)

    def show(self, view: RunView) -> None:
        host = view.state.host
        text = Text(no_wrap=True, overflow="ellipsis")
        width = max(20, self.content_region.width or self.size.width - 2)
        if host is None:
            text.append("no host sample yet", "dim")
        else:
            text.append("RAM ")
            text.append_text(bar(host.used_bytes, host.total_bytes, max(4, min(24, width - 24))))
            text.append(f" {gib(host.used_bytes)}/{gib(host.total_bytes)} GiB\n")
            pinned = "n/a" if host.pinned_bytes is None else f"{gib(host.pinned_bytes)} GiB"
            # The probe's RSS is live (every second); the ranks' own reports only come on log steps.
            rss = host.ranks_rss_bytes or view.ranks_rss_bytes
            text.append(f"ranks RSS {gib(rss)} GiB · pinned {pinned}")
            if view.planned_host_bytes:
                text.append(f" · planned peak {gib(view.planned_host_bytes)} GiB", "dim")
        ranks = sorted(view.state.memory)
        if ranks and len(ranks) <= 8:
            text.append("\n" + " ".join(f"r{r} {gib(view.state.memory[r].host_rss_bytes)}" for r in ranks), "dim")
        self.query_one("#host-text", Static).update(text)
        # One quantity on this axis: the host's used RAM (the fullest GPU has its chart in the GPU panel).
        self.query_one("#memory-plot", LinePlot).series = (
            PlotSeries("host", view.host_used_gib.xs, view.host_used_gib.ys, HOST_COLOR),)
        self.border_subtitle = f"[{HOST_COLOR}]host used, GiB[/]"


class ThroughputPanel(Panel):
    def compose(self) -> ComposeResult:
        yield Static("no step yet", id="throughput-text", markup=False)
        yield LinePlot(id="tokens-plot", empty="tokens/s by step: waiting for steps", fmt=fmt_rate)

    def show(self, view: RunView) -> None:
        s = view.state.last_step
        text = Text(no_wrap=True, overflow="ellipsis")
        if s is None:
            text.append("no step yet", "dim")
        else:
            # Most telling first; packed into as many lines as the panel's width needs (80 columns: 3).
            mfu = "n/a" if s.mfu is None else f"{100 * s.mfu:.1f}%"
            gn = "n/a" if s.grad_norm is None else f"{s.grad_norm:.2f}"
            text = pack([Text(f"{fmt_rate(s.tokens_per_s)} tok/s", "bold"), Text(f"{s.step_s:.3f} s/step"),
                         Text(f"{s.samples_per_s:.1f} samples/s"),
                         Text(f"MFU {mfu}" + (f" (fp8 {s.fp8}, of bf16 peak)" if s.fp8 else "")), Text(f"grad norm {gn}"),
                         Text(f"lr {s.lr:.2e}"), Text(f"{fmt_rate(s.tokens)} tokens")], _width(self))
        self.query_one("#throughput-text", Static).update(text)
        self.query_one("#tokens-plot", LinePlot).series = (
            PlotSeries("tokens/s", view.tokens_per_s.xs, view.tokens_per_s.ys, TOKENS_COLOR),)


class LossPanel(Panel):
    def compose(self) -> ComposeResult:
        yield Static("no step yet", id="loss-text", markup=False)
        yield LinePlot(id="loss-plot", empty="loss by step: waiting for steps", fmt=lambda v: f"{v:.2f}")

    def show(self, view: RunView) -> None:
        s = view.state.last_step
        text = Text(no_wrap=True, overflow="ellipsis")
        if s is None:
            text.append("no step yet", "dim")
        else:
            loss = "n/a" if s.loss is None else f"{s.loss:.4f}"
            items = [Text(f"loss {loss}", "bold")]
            if view.min_loss is not None and (s.loss is None or view.min_loss < s.loss):
                items[0].append(f" (min {view.min_loss:.4f})", "not bold")
            if preference_text(s):          # a DPO / ORPO run: the loss is the preference loss
                items.append(Text(preference_text(s)))
            if reward_text(s):              # a GRPO run: its rewards, completion length, KL, time sampling
                items.append(Text(reward_text(s)))
            evals = view.state.evals
            if evals:
                e = evals[-1]
                items.append(Text(f"eval {'n/a' if e.loss is None else f'{e.loss:.4f}'} at step {e.step}"
                                  + (f", {preference_text(e)}" if preference_text(e) else ""), EVAL_COLOR))
            scale = "n/a (not fp16)" if s.loss_scale is None else f"{s.loss_scale:g}"
            items += [Text(f"loss scale {scale}"), Text(f"{s.skipped_steps} skipped",
                                                        "yellow" if s.skipped_steps else "")]
            text = pack(items, _width(self))
        d = view.state.data
        if d is not None:
            # synthetic tokens have no records, tokens or epochs to count (they were shown as 0)
            text.append(f"\ndata {SYNTHETIC}" if d.format == "synthetic" else
                        f"\ndata {d.format}: {count(d.records, 'record')}, {count(d.tokens, 'token')}, "
                        f"{count(d.samples, 'sample')}, {100 * d.loss_share:.0f}% under loss, {d.epochs:.2f} "
                        f"epochs · tokenizer {d.tokenizer or 'n/a'}", "dim")
        self.query_one("#loss-text", Static).update(text)
        series = [PlotSeries("loss", view.loss.xs, view.loss.ys, LOSS_COLOR)]
        if len(view.eval_loss):
            series.append(PlotSeries("eval", view.eval_loss.xs, view.eval_loss.ys, EVAL_COLOR))
        self.query_one("#loss-plot", LinePlot).series = tuple(series)


def _width(panel: Panel) -> int:
    """The panel's text width (before its first layout: wide enough for one line, as before)."""
    if panel.content_region.width:
        return panel.content_region.width
    return max(20, panel.size.width - 4) if panel.size.width else 200
