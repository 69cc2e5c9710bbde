"""Kills checkpointed training runs with SIGKILL at random moments and checks the resume.

For each example (`examples/moe_lm/train.py --preset tiny` and `examples/sharded_moe.py`
on 8 simulated CPU devices) it first trains once without interruption, then runs the
same command again in a fresh checkpoint directory, kills it with SIGKILL and restarts
it with the same command until it finishes, over and over until `--kills` kills are
done. The kill moments are drawn among:

* `save`: just after the run prints that an (asynchronous) save started, after a random
  delay of 0-150 ms, so mostly while Orbax is still writing the step's temporary
  directory (whether it was, is recorded: a `*.orbax-checkpoint-tmp*` directory present
  at the moment of the kill);
* `between`: 0-400 ms after a save completed, while the next steps train;
* `random`: a random time after the launch (also during start-up and compilation);
* `corrupt`: as `between`, then a byte-flip or a truncation of an array file of the
  newest step, which the restart must detect and skip.

Every run prints a sha256 of params + optimizer state at each save and restore
(`--ckpt-fingerprints`): a restore whose fingerprint is not the uninterrupted run's at
that step would be a resume from a partial or damaged checkpoint (counted, must be 0),
and the final fingerprint must equal the uninterrupted run's (bitwise equal params and
state). Steps lost per kill: the furthest step the killed process reached (its progress
output, a lower bound) minus the step the restart resumed from.

  taskset -c 1 python tools/crash_resume.py --kills 20          # both examples
  taskset -c 1 python tools/crash_resume.py --target moe_lm --kills 3 --out /tmp/crash

Writes `<out>/crash_resume.json` and `<out>/crash_resume.md` (the table also printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from examples import _cli  # noqa: E402
from examples import checkpointing  # noqa: E402

MODES = ('save', 'between', 'random', 'corrupt')
# `--optimizer NAME`: every tier preset, AdamPM and the AdamW baseline, by the name of
# examples/moe_lm/optimizers.py (any of its names works too).
PRESETS = {
    'skewadam': 'skewadam',  # sj.PUBLISHED_TIERS
    'muon': 'skewadam-muon-orthogonal-experts',  # sj.MUON_TIERS
    'muon-coded': 'skewadam-muon-coded-6bit-8bit-backbone-nearest-min4096',  # MUON_CODED_TIERS
    'adampm': 'adampm',
    'adamw': 'adamw',
}
SHARDED_OPTIMIZERS = ('skewadam', 'adampm', 'adamw')  # examples/sharded_moe.py's choices
# A launch that runs over this many times the uninterrupted run's seconds (and at least
# --launch-timeout) is hung: the bound follows the machine's speed, not a fixed number.
LAUNCH_TIMEOUT_FACTOR = 20
LAUNCH_TIMEOUT_S = 600
FP_RE = re.compile(r'checkpoint: step (\d+) fingerprint (\w+)')
RESTORED_RE = re.compile(r'checkpoint: restored step (\d+) fingerprint (\w+)')
SAVING_RE = re.compile(r'checkpoint: saving step (\d+)')
COMPLETE_RE = re.compile(r'checkpoint: step (\d+) complete')
DAMAGED_RE = re.compile(r'checkpoint: step (\d+) in .* is (damaged|incomplete)')
PROGRESS_RE = re.compile(r'(\d+)/(\d+) \[')  # tqdm
STEP_RE = re.compile(r'^step\s+(\d+)\s+loss')  # sharded_moe.py


def command(target: str, args: argparse.Namespace, ckpt: Path, data: Path, out: Path
            ) -> list[str]:
  """The training command of `target`, checkpointing to `ckpt`."""
  common = ['--steps', str(args.steps), '--ckpt-dir', str(ckpt), '--ckpt-every',
            str(args.every), '--ckpt-fingerprints', '--data-dir', str(data),
            '--seed', str(args.seed)]
  if target == 'moe_lm':
    # One optimizer: train.py's default trains two, each in its own checkpoint directory.
    return [sys.executable, 'examples/moe_lm/train.py', '--preset', 'tiny', '--optimizer',
            PRESETS.get(args.optimizer, args.optimizer), '--batch-size', '4',
            '--eval-every', str(args.steps),
            '--eval-batches', '1', '--out', str(out), *common]
  return [sys.executable, 'examples/sharded_moe.py', '--preset', 'tiny', '--batch-size', '8',
          '--optimizer', args.optimizer, *common]


@dataclasses.dataclass
class Launch:
  """What one process printed and how it ended."""
  mode: Optional[str]
  killed: bool = False
  returncode: Optional[int] = None
  during_save: bool = False  # a temporary step directory existed when it was killed
  reached: int = 0  # furthest step seen in its output
  restored: Optional[tuple[int, str]] = None
  skipped: list[int] = dataclasses.field(default_factory=list)
  fingerprints: dict[int, str] = dataclasses.field(default_factory=dict)
  corrupted: Optional[str] = None
  # After a kill: the newest step with a manifest that was not corrupted afterwards, the
  # one the restart must resume from (None: nothing complete on disk, start afresh).
  newest_complete: Optional[int] = None
  seconds: float = 0.0
  tail: list[str] = dataclasses.field(default_factory=list)


def _reader(stream: Any, lines: queue.Queue) -> None:
  buf = b''
  while True:
    chunk = stream.read1(4096) if hasattr(stream, 'read1') else stream.read(4096)
    if not chunk:
      break
    buf += chunk
    parts = re.split(rb'[\r\n]', buf)
    buf = parts.pop()
    for p in parts:
      lines.put(p.decode(errors='replace'))
  if buf:
    lines.put(buf.decode(errors='replace'))
  lines.put(None)


def _tmp_dirs(ckpt: Path) -> list[Path]:
  return list(ckpt.glob('*.orbax-checkpoint-tmp*')) if ckpt.exists() else []


def _parse(launch: Launch, line: str) -> None:
  launch.tail = (launch.tail + [line])[-40:]
  if m := FP_RE.search(line):
    launch.fingerprints[int(m[1])] = m[2]
    launch.reached = max(launch.reached, int(m[1]))
  if m := RESTORED_RE.search(line):
    launch.restored = (int(m[1]), m[2])
    launch.reached = max(launch.reached, int(m[1]))
  if m := DAMAGED_RE.search(line):
    launch.skipped.append(int(m[1]))
  if m := PROGRESS_RE.search(line):
    launch.reached = max(launch.reached, int(m[1]))
  if m := STEP_RE.search(line.strip()):
    launch.reached = max(launch.reached, int(m[1]))


def run_once(cmd: list[str], env: dict[str, str], ckpt: Path, mode: Optional[str],
             rng: random.Random, expected_s: float,
             timeout_s: float = LAUNCH_TIMEOUT_S) -> Launch:
  """Runs `cmd`; with a `mode`, kills it with SIGKILL at a moment of that kind."""
  launch = Launch(mode)
  t0 = time.monotonic()
  proc = subprocess.Popen(cmd, cwd=env['CRASH_RESUME_REPO'], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
  lines: queue.Queue = queue.Queue()
  threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
  events = rng.randint(1, 2)  # kill at the first or second event of the mode's kind
  kill_at = t0 + rng.uniform(0.0, expected_s) if mode == 'random' else None
  seen = 0
  try:
    while True:
      if kill_at is not None and time.monotonic() >= kill_at:
        break
      try:
        line = lines.get(timeout=0.01)
      except queue.Empty:
        if time.monotonic() - t0 > timeout_s:
          proc.kill()
          raise RuntimeError(
              f'{cmd} ran over {timeout_s:.0f} s:\n' + '\n'.join(launch.tail)) from None
        continue
      if line is None:  # the process ended by itself
        break
      _parse(launch, line)
      if mode == 'save' and SAVING_RE.search(line):
        seen += 1
        if seen == events:
          kill_at = time.monotonic() + rng.uniform(0.0, 0.15)
      elif mode in ('between', 'corrupt') and COMPLETE_RE.search(line):
        seen += 1
        if seen == events:
          kill_at = time.monotonic() + rng.uniform(0.0, 0.4)
    if mode is not None and proc.poll() is None:
      launch.during_save = bool(_tmp_dirs(ckpt))
      proc.send_signal(signal.SIGKILL)
      launch.killed = True
  finally:
    proc.wait()
  while True:  # what it printed before it died
    try:
      line = lines.get(timeout=1.0)
    except queue.Empty:
      break
    if line is None:
      break
    _parse(launch, line)
  launch.returncode = proc.returncode
  launch.seconds = time.monotonic() - t0
  if launch.killed and mode == 'corrupt':
    launch.corrupted = corrupt_newest(ckpt, rng)
  if launch.killed:
    steps = _complete_steps(ckpt)
    if launch.corrupted:
      steps = steps[1:]
    launch.newest_complete = steps[0] if steps else None
  return launch


def _complete_steps(ckpt: Path) -> list[int]:
  """The steps in `ckpt` whose manifest was written (committed saves), newest first."""
  if not ckpt.exists():
    return []
  return sorted((int(p.name) for p in ckpt.iterdir()
                 if p.name.isdigit() and (p / checkpointing.MANIFEST).exists()), reverse=True)


def corrupt_newest(ckpt: Path, rng: random.Random) -> Optional[str]:
  """Truncates or flips bytes of the largest array file of the newest complete step.

  Only when an older complete step is there to fall back to (with none, the restart
  rightly stops with an error, which is tested elsewhere).
  """
  steps = _complete_steps(ckpt)
  if len(steps) < 2:
    return None
  files = [p for p in (ckpt / str(steps[0]) / 'state').rglob('*')
           if p.is_file() and '/d/' in p.as_posix()]
  if not files:
    return None
  victim = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(victim.read_bytes())
  if rng.random() < 0.5:
    victim.write_bytes(bytes(data[:len(data) // 2]))
    how = 'truncated'
  else:
    for i in rng.sample(range(len(data)), min(8, len(data))):
      data[i] ^= 0xFF
    victim.write_bytes(bytes(data))
    how = 'bytes flipped'
  return f'step {steps[0]}: {victim.relative_to(ckpt)} {how}'


def run_target(target: str, args: argparse.Namespace, work: Path, env: dict[str, str],
               rng: random.Random) -> dict[str, Any]:
  """The reference run, then killed-and-restarted episodes until `args.kills` kills."""
  from tqdm.auto import tqdm

  data = work / 'data'
  for old in work.glob(f'{target}_*'):  # checkpoints of an earlier call
    shutil.rmtree(old)
  ref_ckpt = work / f'{target}_reference'
  ref = run_once(command(target, args, ref_ckpt, data, work / 'out'), env, ref_ckpt, None,
                 rng, 0.0, args.launch_timeout)
  if ref.returncode != 0 or args.steps not in ref.fingerprints:
    raise RuntimeError(f'reference run of {target} failed:\n' + '\n'.join(ref.tail))
  kills: list[dict[str, Any]] = []
  episodes: list[dict[str, Any]] = []
  bar = tqdm(total=args.kills, desc=f'{target} kills', dynamic_ncols=True)
  while len(kills) < args.kills:
    ckpt = work / f'{target}_episode{len(episodes)}'
    cmd = command(target, args, ckpt, data, work / 'out')
    launches: list[Launch] = []
    while True:
      mode = rng.choice(MODES) if len(kills) < args.kills else None
      launch = run_once(cmd, env, ckpt, mode, rng, ref.seconds,
                        max(args.launch_timeout, LAUNCH_TIMEOUT_FACTOR * ref.seconds))
      if launches and launches[-1].killed:  # the restart after a kill
        prev = launches[-1]
        resumed = launch.restored[0] if launch.restored else 0
        kills[-1].update(resumed_from=resumed, steps_lost=max(0, prev.reached - resumed),
                         skipped_on_restart=launch.skipped,
                         resume=_resume_verdict(prev.newest_complete, launch))
      launches.append(launch)
      if launch.killed:
        kills.append({'episode': len(episodes), 'mode': mode, 'during_save': launch.during_save,
                      'reached': launch.reached, 'corrupted': launch.corrupted,
                      'newest_complete': launch.newest_complete,
                      'after_s': round(launch.seconds, 2)})
        bar.update(1)
        continue
      if launch.returncode != 0:
        raise RuntimeError(f'{target} exited with {launch.returncode} without a kill:\n'
                           + '\n'.join(launch.tail))
      break
    # Resumes whose state is not the uninterrupted run's at that step, and the steps
    # each trained from it (up to where its process got).
    partial, partial_steps = 0, 0
    for launch in launches:
      if launch.restored is None:
        continue
      step, fp = launch.restored
      if ref.fingerprints.get(step) != fp:
        partial += 1
        partial_steps += max(launch.reached - step, 0)
    final = next((la.fingerprints.get(args.steps) or (la.restored or (None, None))[1]
                  for la in reversed(launches)
                  if args.steps in la.fingerprints or la.restored), None)
    episodes.append({
        'launches': len(launches), 'kills': sum(la.killed for la in launches),
        'resumes': sum(la.restored is not None for la in launches),
        'partial_resumes': partial, 'steps_from_partial': partial_steps,
        'final_fingerprint': final, 'bitwise_equal': final == ref.fingerprints[args.steps],
        'seconds': round(sum(la.seconds for la in launches), 1)})
  bar.close()
  return {'target': target, 'optimizer': PRESETS.get(args.optimizer, args.optimizer),
          'command': ['python', *command(target, args, Path('CKPT'), Path('DATA'),
                                         Path('OUT'))[1:]],
          'reference_fingerprints': ref.fingerprints, 'reference_s': round(ref.seconds, 1),
          'kills': kills, 'episodes': episodes, 'summary': summarize(kills, episodes)}


def _free_port() -> int:
  import socket
  with socket.socket() as sock:
    sock.bind(('localhost', 0))
    return sock.getsockname()[1]


def run_pair(script: Path, ckpt: Path, out: Path, env: dict[str, str], kill: Optional[int],
             rng: random.Random, timeout_s: float = LAUNCH_TIMEOUT_S) -> dict[str, Any]:
  """Both `jax.distributed` processes of tests/support/multihost_runs.py `ckpt`; with `kill`, one
  of them (drawn) is killed right after it prints that the save of step `kill` started,
  and the other once it has stopped or after 30 s (a collective with a dead peer hangs)."""
  port = str(_free_port())
  procs, queues = [], []
  for pid in ('0', '1'):
    proc = subprocess.Popen([sys.executable, str(script), 'ckpt', pid, port, str(out), str(ckpt)],
                            cwd=env['CRASH_RESUME_REPO'], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True).start()
    procs.append(proc)
    queues.append(q)
  victim = rng.randint(0, 1)
  record: dict[str, Any] = {'victim': victim if kill else None, 'killed_at_save': kill,
                            'restored': None, 'reached': 0, 'during_save': False}
  tails: list[list[str]] = [[], []]
  t0 = time.monotonic()
  killed_at: Optional[float] = None
  while any(p.poll() is None for p in procs) or any(not q.empty() for q in queues):
    for i, q in enumerate(queues):
      while not q.empty():
        line = q.get()
        if line is None:
          continue
        tails[i] = (tails[i] + [line])[-30:]
        if m := RESTORED_RE.search(line) or re.search(r'checkpoint: restored step (\d+)', line):
          record['restored'] = int(m[1])
        if m := re.match(r'step (\d+)$', line.strip()):
          record['reached'] = max(record['reached'], int(m[1]))
        if (kill and killed_at is None and i == victim and SAVING_RE.search(line)
            and int(SAVING_RE.search(line)[1]) == kill):
          time.sleep(rng.uniform(0.0, 0.1))
          record['during_save'] = bool(_tmp_dirs(ckpt))
          procs[victim].send_signal(signal.SIGKILL)
          killed_at = time.monotonic()
    if killed_at is not None and time.monotonic() - killed_at > 30:
      for p in procs:
        if p.poll() is None:
          p.send_signal(signal.SIGKILL)
    if time.monotonic() - t0 > timeout_s:
      for p in procs:
        p.kill()
      raise RuntimeError('multihost run ran over its time:\n' + '\n'.join(tails[0] + tails[1]))
    time.sleep(0.01)
  record['returncodes'] = [p.wait() for p in procs]
  record['seconds'] = round(time.monotonic() - t0, 1)
  if kill is None and record['returncodes'] != [0, 0]:
    raise RuntimeError('multihost run failed:\n' + '\n'.join(tails[0] + ['---'] + tails[1]))
  return record


def run_multihost(args: argparse.Namespace, work: Path, env: dict[str, str],
                  rng: random.Random) -> dict[str, Any]:
  """Two processes of one mesh: an uninterrupted run, then kills of one process at a
  save until `args.multihost_kills` are done, each followed by a restart of both."""
  import numpy as np

  script = Path(env['CRASH_RESUME_REPO']) / 'tests' / 'support' / 'multihost_runs.py'
  for old in work.glob('multihost_*'):
    shutil.rmtree(old)
  ref_out, out = work / 'multihost_ref_out', work / 'multihost_out'
  ref_out.mkdir()
  out.mkdir()
  env = dict(env, XLA_FLAGS='')
  reference = run_pair(script, work / 'multihost_ref', ref_out, env, None, rng,
                       args.launch_timeout)
  timeout = max(args.launch_timeout, LAUNCH_TIMEOUT_FACTOR * reference['seconds'])
  launches = []
  saves = list(range(4, 15, 2))  # CKPT_EVERY = 2, CKPT_STEPS = 16 in multihost_runs.py
  for _ in range(args.multihost_kills):
    launches.append(run_pair(script, work / 'multihost_ckpt', out, env,
                             rng.choice(saves), rng, timeout))
  while True:
    final = run_pair(script, work / 'multihost_ckpt', out, env, None, rng, timeout)
    launches.append(final)
    if final['returncodes'] == [0, 0]:
      break
  for i in range(1, len(launches)):
    launches[i - 1]['resumed_from'] = launches[i]['restored'] or 0
  a = np.load(ref_out / 'ckpt_skewadam.npz')
  b = np.load(out / 'ckpt_skewadam.npz')
  equal = sorted(a.files) == sorted(b.files) and all(
      a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a.files)
  return {'target': 'multihost (2 processes, gloo)', 'reference_s': reference['seconds'],
          'launches': launches, 'bitwise_equal': bool(equal), 'arrays_compared': len(a.files)}


def _resume_verdict(newest: Optional[int], restart: Launch) -> str:
  """Whether the restart after a kill resumed where it must: from `newest` (the newest
  intact complete step), or afresh when there was none.

  'unknown' when the restart was itself killed before it said either (no restore line
  and no step trained).
  """
  if restart.restored is not None:
    return 'right' if restart.restored[0] == newest else 'wrong'
  if restart.reached == 0 and restart.killed:
    return 'unknown'
  return 'right' if newest is None else 'wrong'


def summarize(kills: list[dict[str, Any]], episodes: list[dict[str, Any]]) -> dict[str, Any]:
  lost = [k['steps_lost'] for k in kills if 'steps_lost' in k]
  corrupted = [k for k in kills if k['corrupted']]
  return {
      'kills': len(kills),
      'kills_during_save': sum(k['during_save'] for k in kills),
      'kills_by_mode': {m: sum(k['mode'] == m for k in kills) for m in MODES},
      'corruptions': len(corrupted),
      'corruptions_detected': sum(int(k['corrupted'].split()[1].rstrip(':'))
                                  in k.get('skipped_on_restart', []) for k in corrupted),
      'resumes': sum(e['resumes'] for e in episodes),
      # Kills that left an intact complete step, and restarts that resumed elsewhere.
      'kills_after_a_complete_save': sum(k['newest_complete'] is not None for k in kills),
      'resumes_due': sum(k['newest_complete'] is not None and k.get('resume') != 'unknown'
                         for k in kills),
      'resumes_wrong': sum(k.get('resume') == 'wrong' for k in kills),
      'episodes': len(episodes),
      'steps_lost_mean': sum(lost) / len(lost) if lost else 0.0,
      'steps_lost_max': max(lost, default=0),
      'bitwise_equal': all(e['bitwise_equal'] for e in episodes),
      'partial_resumes': sum(e['partial_resumes'] for e in episodes),
      'steps_from_partial': sum(e['steps_from_partial'] for e in episodes),
  }


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
  lines = [
      f'SIGKILL at random moments, restart with the same command until done; {args.steps} '
      f'steps, a checkpoint every {args.every} (async Orbax), seed {args.seed}.', '',
      '| example | kills | during a save | corrupted after kill (detected) | resumes '
      '| restarts not from the newest intact step | episodes '
      '| steps lost per kill (mean / max) | bitwise equal to uninterrupted '
      '| resumes from a partial checkpoint | steps trained from one |',
      '|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|']
  for r in results:
    s = r['summary']
    lines.append(
        f'| {r["target"]} `{r["optimizer"]}` | {s["kills"]} | {s["kills_during_save"]} | '
        f'{s["corruptions"]} '
        f'({s["corruptions_detected"]}) | {s["resumes"]} | {s["resumes_wrong"]} | '
        f'{s["episodes"]} | '
        f'{s["steps_lost_mean"]:.1f} / {s["steps_lost_max"]} | '
        f'{"yes" if s["bitwise_equal"] else "NO"} | {s["partial_resumes"]} | '
        f'{s["steps_from_partial"]} |')
  lines += ['', 'Kills by moment: ' + '; '.join(
      f'{r["target"]}: ' + ', '.join(f'{m} {n}' for m, n in r['summary']['kills_by_mode'].items())
      for r in results) + '. "During a save": an Orbax temporary step directory existed '
      'when the process was killed. Steps lost: furthest step in the killed process\'s '
      'output (a lower bound) minus the step the restart resumed from. A restart must '
      'resume from the newest step whose save completed and was not damaged afterwards, '
      'or start afresh when there is none (a kill during start-up or the first save).']
  return '\n'.join(lines)


def build_parser() -> argparse.ArgumentParser:
  p = _cli.parser(__doc__.splitlines()[0])
  _cli.option(p, '--target', default='both',
              choices=('both', 'moe_lm', 'sharded_moe', 'none'),
              help='which example to kill')
  _cli.option(p, '--optimizer', default='skewadam',
              help='the optimizer trained: ' + ', '.join(f'{k} ({v})' for k, v in PRESETS.items())
                   + ', or any name of examples/moe_lm/optimizers.py (moe_lm); sharded_moe '
                   f'takes {", ".join(SHARDED_OPTIMIZERS)}')
  _cli.option(p, '--launch-timeout', type=float, default=LAUNCH_TIMEOUT_S,
              help='seconds after which the uninterrupted run counts as hung; a later '
                   f'launch gets at least {LAUNCH_TIMEOUT_FACTOR}x the seconds that run took')
  _cli.option(p, '--kills', type=int, default=20, help='kills per example')
  _cli.option(p, '--steps', type=int, default=40, help='training steps per run')
  _cli.option(p, '--every', type=int, default=4, help='steps between checkpoints')
  _cli.option(p, '--seed', type=int, default=0, help='training seed and kill schedule')
  _cli.option(p, '--out', default='benchmarks/results', help='directory of the JSON and table')
  _cli.option(p, '--multihost-kills', type=int, default=0,
              help='also kill one of the two jax.distributed processes this many times')
  _cli.option(p, '--work', default=None,
              help='scratch directory (checkpoints, compile cache); unset: a temporary one')
  return p


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
  args = build_parser().parse_args(argv)
  if args.kills < 1 or args.steps < 2 or not 1 <= args.every < args.steps:
    raise ValueError('need --kills >= 1, --steps >= 2 and 1 <= --every < --steps')
  rng = random.Random(args.seed)
  targets = {'both': ('moe_lm', 'sharded_moe'), 'none': ()}.get(args.target, (args.target,))
  if 'sharded_moe' in targets and args.optimizer not in SHARDED_OPTIMIZERS:
    raise ValueError(f'--optimizer {args.optimizer} is not one of sharded_moe.py\'s '
                     f'{SHARDED_OPTIMIZERS}: use --target moe_lm')
  if 'moe_lm' in targets:
    from examples.moe_lm import optimizers as opt_lib
    name = PRESETS.get(args.optimizer, args.optimizer)
    if name not in opt_lib.OPTIMIZERS:
      raise ValueError(f'--optimizer must be one of {sorted(PRESETS)} or a name of '
                       f'examples/moe_lm/optimizers.py, got {args.optimizer!r}.')
  with tempfile.TemporaryDirectory() as tmp:
    work = Path(args.work or tmp)
    work.mkdir(parents=True, exist_ok=True)
    # The committed code (`git archive HEAD`), so that every launch runs the same code
    # even while the working tree changes; the library's sources are also the corpus
    # (small: fast to load).
    repo = work / 'repo'
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir()
    archive = subprocess.run(['git', 'archive', 'HEAD', 'skewadam_jax', 'examples', 'tests'],
                             cwd=ROOT,
                             check=True, capture_output=True).stdout
    subprocess.run(['tar', '-x', '-C', str(repo)], input=archive, check=True)
    commit = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    data = work / 'data'
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(repo / 'skewadam_jax', data)
    env = dict(os.environ)
    env.pop('XLA_FLAGS', None)
    env['JAX_PLATFORMS'] = 'cpu'
    # Restarts reuse the compiled steps: the same executables, so the same bits.
    env['JAX_COMPILATION_CACHE_DIR'] = str(work / 'jax_cache')
    env['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
    env['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'
    env['PYTHONPATH'] = str(repo)
    env['CRASH_RESUME_REPO'] = str(repo)
    results = [run_target(t, args, work, env, rng) for t in targets]
    multihost = run_multihost(args, work, env, rng) if args.multihost_kills else None
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  md = table(results, args) if results else ''
  stem = 'crash_resume' if results else 'crash_resume_multihost'
  if multihost is not None:
    kills = [la for la in multihost['launches'] if la['killed_at_save']]
    md += ('\n\n' if md else '') + (
        f'{multihost["target"]}: {len(kills)} kill(s) of one process right after it started '
        f'the save of step(s) {", ".join(str(k["killed_at_save"]) for k in kills)} '
        f'({sum(k["during_save"] for k in kills)} with a temporary step directory present), '
        'both processes restarted each time, resumed from step(s) '
        f'{", ".join(str(k.get("resumed_from")) for k in kills)}; final params + state '
        f'({multihost["arrays_compared"]} arrays) bitwise equal to an uninterrupted run: '
        f'{"yes" if multihost["bitwise_equal"] else "NO"}.')
  (out / f'{stem}.json').write_text(json.dumps(
      {'args': {k: v for k, v in vars(args).items() if k != 'work'},  # no machine paths
       'commit': commit, 'results': results, 'multihost': multihost},
      indent=1, default=str))
  (out / f'{stem}.md').write_text('# Crash and resume\n\n' + md + '\n')
  print(md)
  return results


if __name__ == '__main__':
  main()
