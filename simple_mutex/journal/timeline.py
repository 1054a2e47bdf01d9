"""Who held which lock, when: a journal drawn as one self-contained HTML page.

::

    simple-mutex timeline /var/log/mutex-journal -o timeline.html
    python -m simple_mutex.journal.timeline host-1-4242.jsonl host-2-*.jsonl -o timeline.html

The page is an SVG Gantt chart, one row per key: each hold a bar coloured by its holder
(``<rect class="hold" data-key data-fence data-pid>`` with a ``<title>`` naming holder,
fence and duration), a wait a thin grey bar under it from the start of the acquire to its
end, a try-once that found the key busy a tick, a timed-out wait a red tick; a takeover of
a lapsed holder is a triangle at the start of the new hold, a lost lease a red cross at
its end, and a hold whose end the journal never saw (its process was killed, or still
runs) a dashed bar to its lease's expiry. A call parked in its key's line
(``on_busy="queue"``) is a translucent violet band under the key's holds, from its
``parked`` event to its ``promoted`` one (``<rect class="parked" data-key data-ticket>``;
overlapping calls darken it; one the journal never saw promoted is outlined, drawn to the
journal's end). Below it, a table per key. No script, no network:
the page opens from a file, offline, and mails as one attachment. Every string from the
journal (keys are user input) is escaped.

Holds are matched by key, fence, slot and the holder's pid: an ``acquired`` line opens
one, the ``released`` or ``lost`` line of the same holder closes it (a close whose opening
line is missing starts at ``at - held``). The files are read by ``journal.read``: lines
that are not journal lines are reported as ``file:line: why`` and skipped; identical lines
(a process that journals twice into the same directory) count once.
"""

from __future__ import annotations

import argparse
import html
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from simple_mutex.events import LockEvent
from simple_mutex.journal import Record, read

# -- what happened: holds, waits, ticks ---------------------------------------------------

MIN_WAIT = 0.001
"""An acquire that took less than this found the key free: its time is the cache's round
trip, not a wait, and is not drawn."""


@dataclass
class Hold:
    key: str
    fence: int | None
    slot: int
    host: str
    pid: int | None
    label: str | None
    start: datetime
    end: datetime | None = None
    expires: datetime | None = None
    ending: str = "open"
    """released, lost, or open (the journal never saw it end)"""
    took_over: bool = False
    reason: str | None = None


@dataclass(frozen=True)
class Wait:
    key: str
    start: datetime
    end: datetime
    outcome: str
    """acquired, busy or timed_out"""
    who: str


@dataclass
class Parking:
    """A call parked in its key's line, from ``parked`` to ``promoted`` (its wait)."""

    key: str
    ticket: int | None
    name: str
    start: datetime
    end: datetime | None = None
    by: str | None = None
    """Who promoted it (end, sweep, revoke, parent); None: the journal never saw it."""


@dataclass
class Timeline:
    holds: list[Hold] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)
    ticks: list[Wait] = field(default_factory=list)
    """busy and timed_out, at their end"""
    keys: list[str] = field(default_factory=list)
    """in the order they first appear"""
    parkings: list[Parking] = field(default_factory=list)


def build(records: Iterable[Record | LockEvent]) -> Timeline:
    """Holds, waits and ticks from records in any order."""
    found = [r if isinstance(r, Record) else Record(r) for r in records]
    found.sort(key=lambda r: r.event.at)
    timeline = Timeline()
    keys: dict[str, None] = {}
    open_holds: dict[tuple[str, int | None, int, int | None], Hold] = {}
    open_parks: dict[tuple[str, int | None], Parking] = {}
    for record in found:
        event = record.event
        keys.setdefault(event.key)
        if event.kind in ("parked", "promoted"):
            _park(event, open_parks, timeline)
            continue
        if event.waited is not None and event.waited >= MIN_WAIT and event.kind != "released":
            start = datetime.fromtimestamp(event.at.timestamp() - event.waited, timezone.utc)
            timeline.waits.append(Wait(event.key, start, event.at, event.kind, _who(record)))
        if event.kind in ("busy", "timed_out"):
            timeline.ticks.append(Wait(event.key, event.at, event.at, event.kind, _who(record)))
            continue
        holder = event.holder
        pid = holder.pid if holder is not None else record.pid
        ident = (event.key, event.fence, event.slot or 0, pid)
        hold = open_holds.get(ident)
        if hold is None:  # a grant, or a close or renewal whose grant is not in the journal
            began = event.at
            if event.kind != "acquired":  # its opening line is not in the journal
                began = datetime.fromtimestamp(event.at.timestamp() - (event.held or 0),
                                               timezone.utc)  # fmt: skip
            hold = Hold(
                key=event.key, fence=event.fence, slot=event.slot or 0,
                host=holder.host if holder is not None else (record.host or "?"),
                pid=pid, label=holder.label if holder is not None else None,
                start=began, took_over=event.took_over,
            )  # fmt: skip
            timeline.holds.append(hold)
            open_holds[ident] = hold
        if holder is not None:
            hold.expires = holder.expires_at
        if event.kind in ("released", "lost"):
            hold.end, hold.ending, hold.reason = event.at, event.kind, event.reason
            del open_holds[ident]
    last = found[-1].event.at if found else None
    for hold in open_holds.values():
        # Drawn to its lease's expiry (when a takeover may follow), never past the journal.
        ends = [t for t in (hold.expires, last) if t is not None]
        hold.end = max(hold.start, min(ends))
    for parking in open_parks.values():
        parking.end = max(parking.start, last) if last is not None else parking.start
    timeline.keys = list(keys)
    return timeline


def _park(
    event: LockEvent, open_parks: dict[tuple[str, int | None], Parking], timeline: Timeline
) -> None:
    """A ``parked`` line opens a wait of (key, ticket), its ``promoted`` line closes it;
    a promotion whose park is not in the journal starts at ``at - waited``. A second park
    of an open ticket (its broker's copy) changes nothing; a second promotion (a sweep
    published it again) is drawn from its own wait."""
    ident = (event.key, event.ticket)
    parking = open_parks.get(ident)
    if event.kind == "parked":
        if parking is None:
            parking = Parking(event.key, event.ticket, event.name, event.at)
            open_parks[ident] = parking
            timeline.parkings.append(parking)
        return
    if parking is None:
        began = datetime.fromtimestamp(event.at.timestamp() - (event.waited or 0), timezone.utc)
        parking = Parking(event.key, event.ticket, event.name, began)
        timeline.parkings.append(parking)
    else:
        del open_parks[ident]
    parking.end, parking.by = event.at, event.reason or "?"


def _who(record: Record) -> str:
    if record.pid is None:
        return "a waiter"
    return f"{record.host or '?'} pid {record.pid}"


# -- drawing ------------------------------------------------------------------------------

LABEL_W = 230  # the key column
CHART_W = 1000
LANE_H = 18  # one semaphore slot
WAIT_H = 4
PARK_H = 6  # the band of a key's parked calls, under its waits
ROW_GAP = 10
AXIS_H = 34
MAX_LABEL = 30  # characters of a key shown in its row; the full key is in its tooltip

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px; }
p.meta { color: #555; margin: 0 0 16px; }
svg.chart { display: block; }
svg text { font: 12px system-ui, sans-serif; fill: #333; }
svg .axis text { fill: #666; font-size: 11px; }
.grid { stroke: #e4e4e4; }
.row { fill: #f7f7f7; }
.hold { stroke: #0003; }
.hold:hover, .wait:hover { stroke: #000; stroke-width: 2; }
.hold.open, p.symbols .open { stroke: #333; stroke-dasharray: 4 3; fill-opacity: 0.45; }
.wait { fill: #9a9a9a; }
.tick.busy { stroke: #e08a00; stroke-width: 2; }
.tick.timed_out { stroke: #c62828; stroke-width: 2.5; }
.lost { stroke: #c62828; stroke-width: 2.5; }
.takeover { fill: #000; }
.parked { fill: #6a3fc4; fill-opacity: 0.3; }
.parked.open { fill-opacity: 0.12; stroke: #6a3fc4; stroke-dasharray: 3 2; }
.parked:hover { stroke: #000; stroke-width: 1.5; }
table { border-collapse: collapse; margin-top: 20px; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.swatch { display: inline-block; width: 12px; height: 12px; margin-right: 6px;
          vertical-align: -1px; border: 1px solid #0003; }
ul.legend { list-style: none; padding: 0; margin: 8px 0; columns: 3; }
.problems { color: #a33; }
p.symbols svg { vertical-align: middle; margin-left: 10px; }
"""


def render(events: Iterable[Record | LockEvent], *, skipped: Sequence[str] = ()) -> str:
    """One self-contained HTML page drawing ``events`` (``LockEvent``s, e.g. collected
    with ``events.subscribe``, or journal ``Record``s). ``skipped``: reports of journal
    lines left out, listed on the page."""
    timeline = build(events)
    body = [f"<h1>simple-mutex timeline</h1>{_meta(timeline)}"]
    if timeline.holds or timeline.waits or timeline.ticks or timeline.parkings:
        colours = _colours(timeline.holds)
        body += [_chart(timeline, colours), _legend(colours), _table(timeline)]
    else:
        body.append("<p>No lock events in the journal.</p>")
    if skipped:
        items = "".join(f"<li>{_esc(s)}</li>" for s in skipped)
        body.append(f'<h2>Skipped lines</h2><ul class="problems">{items}</ul>')
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width">'
        f"<title>simple-mutex timeline</title><style>{CSS}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )


def _meta(timeline: Timeline) -> str:
    span = _span(timeline)
    if span is None:
        return ""
    t0, t1 = span
    parked = f"{len(timeline.parkings)} parked, " if timeline.parkings else ""
    return (
        f'<p class="meta">{len(timeline.keys)} keys, {len(timeline.holds)} holds, '
        f"{len(timeline.waits)} waits, {parked}from {_clock(t0, date=True)} to {_clock(t1)} UTC "
        f"({_duration((t1 - t0).total_seconds())}). Hover a bar for its holder.</p>"
    )


def _span(timeline: Timeline) -> tuple[datetime, datetime] | None:
    times = [t for h in timeline.holds for t in (h.start, h.end) if t is not None]
    times += [t for w in (*timeline.waits, *timeline.ticks) for t in (w.start, w.end)]
    times += [t for p in timeline.parkings for t in (p.start, p.end) if t is not None]
    return (min(times), max(times)) if times else None


def _chart(timeline: Timeline, colours: dict[str, tuple[str, str]]) -> str:
    span = _span(timeline)
    assert span is not None
    t0 = span[0].timestamp()
    seconds = max(span[1].timestamp() - t0, 1e-3)

    def x(at: datetime) -> float:
        return LABEL_W + (at.timestamp() - t0) / seconds * CHART_W

    lanes = {key: 1 for key in timeline.keys}
    for hold in timeline.holds:
        lanes[hold.key] = max(lanes[hold.key], hold.slot + 1)
    queued = {parking.key for parking in timeline.parkings}

    def row_height(key: str) -> float:
        return lanes[key] * LANE_H + WAIT_H + 4 + (PARK_H + 2 if key in queued else 0)

    tops: dict[str, float] = {}
    y = float(AXIS_H)
    for key in timeline.keys:
        tops[key] = y
        y += row_height(key) + ROW_GAP
    height = y
    width = LABEL_W + CHART_W + 20
    size = f'width="{width}" height="{height:.0f}" viewBox="0 0 {width} {height:.0f}"'
    out = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" {size} role="img" '
           'aria-label="lock timeline">']  # fmt: skip
    out.append(_axis(seconds, height))
    for key in timeline.keys:
        top, row_h = tops[key], row_height(key)
        shown = key if len(key) <= MAX_LABEL else key[: MAX_LABEL - 1] + "…"
        out.append(
            f'<rect class="row" x="{LABEL_W}" y="{top - 3:.1f}" width="{CHART_W}" '
            f'height="{row_h + 6}"/><text x="{LABEL_W - 8}" y="{top + LANE_H - 5:.1f}" '
            f'text-anchor="end">{_esc(shown)}<title>{_esc(key)}</title></text>'
        )
    for wait in timeline.waits:
        top = tops[wait.key] + lanes[wait.key] * LANE_H + 2
        title = f"{wait.key}\n{wait.who} waited {_duration(_secs(wait))}: {_OUTCOME[wait.outcome]}"
        out.append(
            f'<rect class="wait" x="{x(wait.start):.2f}" y="{top:.1f}" '
            f'width="{max(x(wait.end) - x(wait.start), 1):.2f}" height="{WAIT_H}">'
            f"<title>{_esc(title)}</title></rect>"
        )
    for parking in timeline.parkings:
        top = tops[parking.key] + lanes[parking.key] * LANE_H + WAIT_H + 4
        out.append(_parking(parking, x, top))
    for hold in timeline.holds:
        out.append(_hold(hold, x, tops[hold.key] + hold.slot * LANE_H, colours))
    for tick in timeline.ticks:
        top = tops[tick.key]
        bottom = top + row_height(tick.key) - 2
        title = f"{tick.key}\n{tick.who}: {_OUTCOME[tick.outcome]}"
        out.append(
            f'<line class="tick {tick.outcome}" x1="{x(tick.end):.2f}" x2="{x(tick.end):.2f}" '
            f'y1="{top - 2:.1f}" y2="{bottom:.1f}"><title>{_esc(title)}</title></line>'
        )
    out.append("</svg>")
    return "".join(out)


_OUTCOME = {
    "acquired": "then got it",
    "busy": "found it busy (tried once)",
    "timed_out": "gave up: timed out",
}


def _secs(wait: Wait) -> float:
    return (wait.end - wait.start).total_seconds()


def _parking(parking: Parking, x: Callable[[datetime], float], top: float) -> str:
    assert parking.end is not None
    left, right = x(parking.start), x(parking.end)
    waited = (parking.end - parking.start).total_seconds()
    ticket = "" if parking.ticket is None else str(parking.ticket)
    lines = [
        parking.key,
        f"{parking.name}, ticket {ticket or '?'}: parked {_duration(waited)} from "
        f"{_clock(parking.start)} to {_clock(parking.end)} UTC",
        f"promoted by {parking.by}" if parking.by else "never promoted in the journal",
    ]
    classes = "parked" if parking.by else "parked open"
    return (
        f'<rect class="{classes}" x="{left:.2f}" y="{top:.1f}" '
        f'width="{max(right - left, 1.5):.2f}" height="{PARK_H}" data-key="{_esc(parking.key)}" '
        f'data-ticket="{ticket}"><title>{_esc(chr(10).join(lines))}</title></rect>'
    )


def _hold(
    hold: Hold, x: Callable[[datetime], float], top: float, colours: dict[str, tuple[str, str]]
) -> str:
    assert hold.end is not None
    left, right = x(hold.start), x(hold.end)
    held = (hold.end - hold.start).total_seconds()
    lines = [
        hold.key,
        f"holder {_holder_name(hold)}",
        f"fence {hold.fence}" + (f", slot {hold.slot}" if hold.slot else ""),
        f"held {_duration(held)} from {_clock(hold.start)} to {_clock(hold.end)} UTC",
    ]
    if hold.took_over:
        lines.append("took over from a holder whose lease had lapsed")
    if hold.ending == "lost":
        lines.append(f"LOST: {hold.reason or 'the lease lapsed'}")
    elif hold.ending == "open":
        lines.append("never released in the journal (its process died or still runs); "
                     "drawn to its lease's expiry")  # fmt: skip
    classes = "hold" if hold.ending != "open" else "hold open"
    fence = "" if hold.fence is None else str(hold.fence)
    pid = "" if hold.pid is None else str(hold.pid)
    mid = top + (LANE_H - 2) / 2
    parts = [
        f'<rect class="{classes}" x="{left:.2f}" y="{top:.1f}" '
        f'width="{max(right - left, 1.5):.2f}" height="{LANE_H - 2}" '
        f'fill="{colours[_holder_id(hold)][0]}" data-key="{_esc(hold.key)}" data-fence="{fence}" '
        f'data-pid="{pid}" data-slot="{hold.slot}" data-ending="{hold.ending}">'
        f"<title>{_esc(chr(10).join(lines))}</title></rect>"
    ]
    if hold.took_over:
        parts.append(
            f'<path class="takeover" d="M{left - 5:.2f},{top - 3:.1f} h10 l-5,7 z">'
            f"<title>takeover: fence {fence} after a lapsed lease</title></path>"
        )
    if hold.ending == "lost":
        parts.append(
            f'<path class="lost" d="M{right - 5:.2f},{mid - 5:.1f} l10,10 m0,-10 l-10,10">'
            f"<title>{_esc('lost: ' + (hold.reason or 'the lease lapsed'))}</title></path>"
        )
    return "".join(parts)


def _axis(seconds: float, height: float) -> str:
    step = _nice_step(seconds / 10)
    out = ['<g class="axis">']
    count = int(seconds / step + 1e-9)
    for n in range(count + 1):
        at = n * step
        x = LABEL_W + at / seconds * CHART_W
        out.append(
            f'<line class="grid" x1="{x:.2f}" x2="{x:.2f}" y1="{AXIS_H - 8}" y2="{height:.0f}"/>'
            f'<text x="{x:.2f}" y="{AXIS_H - 14}" text-anchor="middle">+{_duration(at)}</text>'
        )
    out.append("</g>")
    return "".join(out)


def _nice_step(rough: float) -> float:
    """1, 2 or 5 times a power of ten, at least ``rough``."""
    power = 10.0 ** math.floor(math.log10(rough))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= rough)


def _holder_id(hold: Hold) -> str:
    return f"{hold.host}\0{hold.pid}"


def _holder_name(hold: Hold) -> str:
    label = f" ({hold.label})" if hold.label else ""
    return f"{hold.host} pid {hold.pid if hold.pid is not None else '?'}{label}"


def _colours(holds: list[Hold]) -> dict[str, tuple[str, str]]:
    """A colour and a name per holder, by first appearance; hues spread by the golden
    angle, lightness alternating so that neighbours differ."""
    colours: dict[str, tuple[str, str]] = {}
    for hold in holds:
        ident = _holder_id(hold)
        if ident not in colours:
            hue = (len(colours) * 137.508) % 360
            colour = f"hsl({hue:.0f},65%,{52 if len(colours) % 2 else 42}%)"
            colours[ident] = (colour, _holder_name(hold))
    return colours


KEY_TO_SYMBOLS = (
    '<p class="symbols">'
    '<svg width="28" height="12"><rect x="1" y="1" width="26" height="10" fill="#5a8"/></svg>'
    " a hold (its holder's colour) "
    '<svg width="28" height="12"><rect class="open" x="1" y="1" width="26" height="10" '
    'fill="#5a8"/></svg> never released in the journal, drawn to its expiry '
    '<svg width="28" height="12"><rect class="wait" x="1" y="4" width="26" height="4"/></svg>'
    " a wait "
    '<svg width="10" height="14"><line class="tick busy" x1="5" x2="5" y1="0" y2="14"/></svg>'
    " busy (a try-once found it held) "
    '<svg width="10" height="14"><line class="tick timed_out" x1="5" x2="5" y1="0" y2="14"/>'
    "</svg> timed out "
    '<svg width="14" height="10"><path class="takeover" d="M2,1 h10 l-5,7 z"/></svg>'
    " took over a lapsed lease "
    '<svg width="14" height="14"><path class="lost" d="M2,2 l10,10 m0,-10 l-10,10"/></svg>'
    " lost "
    '<svg width="28" height="8"><rect class="parked" x="1" y="1" width="26" height="6"/></svg>'
    " parked in the line (on_busy='queue'), until promoted</p>"
)


def _legend(colours: dict[str, tuple[str, str]]) -> str:
    items = [
        f'<li><span class="swatch" style="background:{colour}"></span>{_esc(name)}</li>'
        for colour, name in colours.values()
    ]
    return f'{KEY_TO_SYMBOLS}<ul class="legend">{"".join(items)}</ul>'


def _table(timeline: Timeline) -> str:
    head = ("<tr><th>key</th><th>holds</th><th>held in all</th><th>longest hold</th>"
            "<th>waits</th><th>longest wait</th><th>busy</th><th>timed out</th>"
            "<th>takeovers</th><th>lost</th><th>never released</th><th>parked</th>"
            "<th>longest parked</th></tr>")  # fmt: skip
    rows = [head]
    for key in timeline.keys:
        holds = [h for h in timeline.holds if h.key == key]
        spans = [((h.end or h.start) - h.start).total_seconds() for h in holds]
        waits = [_secs(w) for w in timeline.waits if w.key == key]
        ticks = [t.outcome for t in timeline.ticks if t.key == key]
        parks = [((p.end or p.start) - p.start).total_seconds() for p in timeline.parkings
                 if p.key == key]  # fmt: skip
        cells = [
            len(holds), _duration(sum(spans)), _duration(max(spans, default=0)),
            len(waits), _duration(max(waits, default=0)), ticks.count("busy"),
            ticks.count("timed_out"), sum(h.took_over for h in holds),
            sum(h.ending == "lost" for h in holds), sum(h.ending == "open" for h in holds),
            len(parks), _duration(max(parks, default=0)),
        ]  # fmt: skip
        rows.append(f"<tr><td>{_esc(key)}</td>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table>{''.join(rows)}</table>"


def _duration(seconds: float) -> str:
    if seconds == 0:
        return "0 s"
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    minutes, rest = divmod(seconds, 60)
    return f"{minutes:.0f} min {rest:.0f} s"


def _clock(at: datetime, *, date: bool = False) -> str:
    text = at.astimezone(timezone.utc).isoformat(sep=" ", timespec="milliseconds")[:-6]
    return text if date else text[11:]


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


# -- command line -------------------------------------------------------------------------


def cli_main(files: list[str], output: str) -> int:
    """Draw the journal files and directories ``files`` into the HTML file ``output``.
    Skipped lines go to stderr as ``file:line: why``; the written path to stdout.
    Returns 0, or 2 when a path is missing or the page cannot be written."""
    try:
        records, problems = read(files)
    except FileNotFoundError as exc:
        print(f"simple-mutex timeline: no such file or directory: {exc.args[0]} (give journal "
              "files or the SIMPLE_MUTEX_JOURNAL directory)", file=sys.stderr)  # fmt: skip
        return 2
    except OSError as exc:
        print(f"simple-mutex timeline: cannot read {exc.filename}: {exc.strerror}",
              file=sys.stderr)  # fmt: skip
        return 2
    for problem in problems:
        print(f"skipped {problem}", file=sys.stderr)
    if not records:
        print("simple-mutex timeline: no lock events found; is SIMPLE_MUTEX_JOURNAL set "
              "for the processes that lock?", file=sys.stderr)  # fmt: skip
    try:
        Path(output).write_text(render(records, skipped=problems), encoding="utf-8")
    except OSError as exc:
        print(f"simple-mutex timeline: cannot write {output}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"timeline written to {Path(output).resolve()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simple_mutex.journal.timeline",
        description="Draw simple-mutex journal files (SIMPLE_MUTEX_JOURNAL) as one HTML page.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE_OR_DIR",
                        help="journal files, or directories of them")  # fmt: skip
    parser.add_argument("-o", "--output", default="timeline.html",
                        help="the HTML file to write (default: timeline.html)")  # fmt: skip
    args = parser.parse_args(argv)
    return cli_main(args.files, args.output)


if __name__ == "__main__":
    sys.exit(main())
