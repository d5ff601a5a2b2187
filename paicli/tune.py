"""`pai tune`: hyperparameter sweeps whose trials are ordinary paicli jobs.

    pai tune job.yaml --space space.yaml --trials 24 --parallel 2 --metric loss --mode min

The command parses the space (`parse_space`), checks the statement, creates the
Optuna study and its row in the store, and starts the tuner in a session of its own
(`python -m paicli.tune HOME NAME`): `pai tune status NAME` re-attaches. The tuner
(`Tuner`) submits each trial through `client`, reports the metric lines the master
stores as intermediate values, and cancels a pruned trial through `client.kill`.
Readers (`study_view`) use the store only: Optuna is imported by the command that
creates a study and by its tuner.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from paicli import client
from paicli.cluster.pluto.view import record
from paicli.cluster.procinfo import is_alive, signal_verified, start_time
from paicli.errors import PaiError, UsageError
from paicli.pluto import auto_strategy
from paicli.private import private_dir, write_private
from paicli.spec import Param, RawParam, close_matches, convert
from paicli.statement import Statement
from paicli.store import Store

DISTRIBUTIONS = ("uniform", "loguniform", "int", "choice")
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "sha", "hyperband", "none")
MODES = ("min", "max")
KEYS = {"uniform": ("type", "low", "high"), "loguniform": ("type", "low", "high"),
        "int": ("type", "low", "high", "log"), "choice": ("type", "values")}
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
STUDY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
POLL = 0.2                # seconds between two looks of the tuner at its trials
MISSING_AFTER_STEPS = 5   # the first trial's steps without the metric before it is called missing
GRID_MAX = 10_000
GIVE_UP_AFTER = 3         # trials failed, none completed: the study fails
STEP_KEYS = ("step", "iteration", "iter", "global_step", "batch")


# -- the search space (pure) -----------------------------------------------------------


@dataclass(frozen=True)
class Dimension:
    """One parameter of the space: `uniform`/`loguniform` (floats), `int`, `choice`."""

    name: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    values: tuple = ()
    log: bool = False


def _number(where: str, key: str, value: Any, whole: bool = False) -> float | int:
    """A YAML number (PyYAML reads `1e-5` as text: that is taken too)."""
    try:
        number = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None:
        raise UsageError(f"{where}: {key} must be {'a whole number' if whole else 'a number'}, not {value!r}",
                         f"e.g. {key}: {1 if whole else 0.001}")
    if not math.isfinite(number):
        raise UsageError(f"{where}: {key} must be a finite number, not {value!r}")
    if whole:
        if not number.is_integer() or abs(number) > 2 ** 53:
            raise UsageError(f"{where}: {key} must be a whole number, not {value!r}", f"e.g. {key}: 1")
        return int(number)
    return number


def _dimension(name: str, entry: Any, where: str) -> Dimension:
    example = "e.g. lr: {type: uniform, low: 0.001, high: 0.1}"
    if not isinstance(entry, dict):
        raise UsageError(f"{where}: expected a mapping with a type, not {entry!r}"[:200], example)
    kind = entry.get("type")
    if kind not in DISTRIBUTIONS:
        close = close_matches(str(kind), DISTRIBUTIONS) if isinstance(kind, str) else []
        tip = f" (did you mean {close[0]}?)" if close else ""
        what = "no type" if kind is None else f"unknown distribution {str(kind)[:40]!r}{tip}"
        raise UsageError(f"{where}: {what}; known: {', '.join(DISTRIBUTIONS)}", example)
    for key in entry:
        if key not in KEYS[kind]:
            raise UsageError(f"{where}: unknown key {str(key)[:40]!r} for type {kind}",
                             f"a {kind} takes {', '.join(KEYS[kind][1:])}")
    if kind == "choice":
        values = entry.get("values")
        if not isinstance(values, list) or not values:
            raise UsageError(f"{where}: a choice needs values: a non-empty list", "e.g. opt: {type: choice, values: [sgd, adam]}")
        for value in values:
            if value is None or not isinstance(value, (str, int, float, bool)) or \
                    (isinstance(value, float) and not math.isfinite(value)):
                raise UsageError(f"{where}: choice values must be text or numbers, not {value!r}"[:200])
        if len({(type(v), v) for v in values}) != len(values):
            raise UsageError(f"{where}: a value is listed twice", "list each value once")
        return Dimension(name, kind, values=tuple(values))
    for key in ("low", "high"):
        if key not in entry:
            raise UsageError(f"{where}: a {kind} needs low and high", example)
    whole = kind == "int"
    low, high = _number(where, "low", entry["low"], whole), _number(where, "high", entry["high"], whole)
    if low > high:
        raise UsageError(f"{where}: low {low:g} is above high {high:g}", "swap them")
    log = kind == "loguniform"
    if kind == "int":
        log = entry.get("log", False)
        if not isinstance(log, bool):
            raise UsageError(f"{where}: log must be true or false, not {log!r}"[:200])
    if log and low <= 0:
        raise UsageError(f"{where}: a log scale needs low above 0, not {low:g}", "e.g. low: 1e-5")
    return Dimension(name, kind, low, high, log=log)


def _shown(name: Any) -> str:
    """A name as an error shows it: escaped when it holds a newline or control character."""
    text = str(name)[:60]
    return text if text.isprintable() else repr(text)


def parse_space(text: str, source: str = "space.yaml") -> list[Dimension]:
    """The space file's parameters, in file order. Bad input: UsageError, one line
    naming the file, its line and the parameter."""
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source} line {mark.line + 1} column {mark.column + 1}" if mark else source
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UsageError(f"{where}: not valid YAML: {problem}", "check the indentation and quoting there") from None
    except (ValueError, RecursionError) as err:  # yaml's own limits on odd input
        raise UsageError(f"{source}: not valid YAML: {str(err)[:80]}") from None
    if not isinstance(data, dict) or not data:
        raise UsageError(f"{source}: expected a mapping of parameters, e.g. lr: {{type: uniform, low: 0.001, high: 0.1}}",
                         "one line per parameter")
    lines: dict[str, int] = {}
    for key_node, _ in node.value:
        key = str(key_node.value)
        if key in lines:
            raise UsageError(f"{source} line {key_node.start_mark.line + 1}: {_shown(key)} is given twice",
                             "keep one of them")
        lines[key] = key_node.start_mark.line + 1
    dims = []
    for name, entry in data.items():
        where = f"{source} line {lines.get(str(name), '?')}: {_shown(name)}"
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise UsageError(f"{where}: a parameter name is a word (letters, digits, _ . -)"[:200],
                             "it reaches the script as --name=value")
        dims.append(_dimension(name, entry, where))
    return dims


def grid_values(dims: list[Dimension]) -> dict[str, list]:
    """The grid sampler's values: a choice's values, every integer of an int."""
    grid = {}
    for dim in dims:
        if dim.kind == "choice":
            grid[dim.name] = list(dim.values)
        elif dim.kind == "int" and dim.high - dim.low < GRID_MAX:
            grid[dim.name] = list(range(dim.low, dim.high + 1))
        else:
            raise UsageError(f"--sampler grid: {dim.name} is a {dim.kind}; a grid needs listed values",
                             f"give {dim.name} as {{type: choice, values: [...]}}, or use --sampler tpe")
    size = math.prod(len(v) for v in grid.values())
    if size > GRID_MAX:
        raise UsageError(f"--sampler grid: {size} points; at most {GRID_MAX}", "list fewer values")
    return grid


# -- a trial's statement (pure) ------------------------------------------------------------


def format_value(value: Any) -> str:
    """A parameter as the script reads it: true/false, a float's shortest exact form."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def targets_of(dims: list[Dimension], known: dict[str, str]) -> dict[str, str | None]:
    """name -> the -D key it sets (a parameter of the job's table, by PAI or snake
    name), or None: then it reaches the script as --name=value."""
    return {dim.name: known.get(dim.name) for dim in dims}


def trial_params(base: dict[str, Any], targets: dict[str, str | None], values: dict[str, Any]) -> dict[str, Any]:
    """The job's -D values for a trial: the base's, the -D keys the space names set,
    the others appended to userDefinedParameters as --name=value."""
    params = dict(base)
    flags = []
    for name, value in values.items():
        if targets.get(name):
            params[targets[name]] = format_value(value)
        else:
            flags.append(shlex.quote(f"--{name}={format_value(value)}"))
    if flags:
        old = params.get("userDefinedParameters")
        params["userDefinedParameters"] = " ".join([old, *flags] if old else flags)
    return params


def _text(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return format_value(value)


def rerun_command(framework: str, project: str | None, params: dict[str, Any]) -> str:
    """The `pai` statement that runs these parameters again (paths absolute)."""
    words = ["pai", "-name", shlex.quote(framework)]
    if project:
        words += ["-project", shlex.quote(project)]
    words += [f"-D{key}={shlex.quote(_text(value))}" for key, value in params.items()]
    return " ".join(words)


def statement_of_params(framework: str, project: str | None, params: dict[str, Any]):
    root = Path("/")
    return Statement(framework, project, [RawParam(k, v, f"-D{k}", root) for k, v in params.items()])


# -- policy (pure) -------------------------------------------------------------------------


def pick_series(rows: list, metric: str, source: tuple | None) -> tuple[tuple | None, list[tuple[int, float]]]:
    """The (step, value) points of `metric` from one instance: `source`, else the
    first instance that printed it. rows: (role, idx, step, key, value)."""
    points = []
    for role, idx, step, key, value in rows:
        if key != metric or step is None:
            continue
        if source is None:
            source = (role, idx)
        if (role, idx) == source:
            points.append((int(step), value))
    return source, points


def missing_metric(steps_seen: int, metric_seen: bool, finished_ok: bool) -> bool:
    """The first trial tells whether the metric exists: it ended well, or printed
    MISSING_AFTER_STEPS steps, and not one line had the metric."""
    return not metric_seen and (finished_ok or steps_seen >= MISSING_AFTER_STEPS)


def trial_forecast(complete_seconds: list[float], pluto_step_s: float | None = None,
                   steps: int | None = None) -> float | None:
    """How long the next trial will take: Pluto's forecast per step times the steps a
    trial runs, where both are known; else the mean of the trials run to completion;
    None before any."""
    if pluto_step_s and steps:
        return pluto_step_s * steps
    if complete_seconds:
        return sum(complete_seconds) / len(complete_seconds)
    return None


def budget_allows(elapsed: float, budget: float | None, forecast: float | None) -> bool:
    """Start another trial only if it should end within the budget."""
    if budget is None:
        return True
    return elapsed + (forecast or 0.0) <= budget


def better(a: float, b: float | None, mode: str) -> bool:
    return b is None or (a < b if mode == "min" else a > b)


def best_of(trials: list, mode: str):
    """The completed trial (a row or dict with a value) of the best value, or None."""
    best = None
    for trial in trials:
        if best is None or better(trial["value"], best["value"], mode):
            best = trial
    return best


def give_up(failed: int, completed: int) -> bool:
    """A statement whose first trials all fail fails every trial: stop after 3."""
    return completed == 0 and failed >= GIVE_UP_AFTER


def median_startup(trials: int) -> int:
    """Trials run to completion before the median pruner judges: few in a short sweep."""
    return max(2, min(5, trials // 4))


# -- options and the study's config -------------------------------------------------------


@dataclass
class TuneOptions:
    space: str = ""
    trials: int = 20
    parallel: int = 1
    metric: str = "loss"
    mode: str = "min"
    budget: float | None = None
    storage: str | None = None
    sampler: str = "tpe"
    pruner: str = "median"
    seed: int | None = None
    study: str | None = None
    detach: bool = False


OPTIONS = {"--space": ("space", str), "--trials": ("trials", int), "--parallel": ("parallel", int),
           "--metric": ("metric", str), "--mode": ("mode", str), "--budget": ("budget", "duration"),
           "--storage": ("storage", str), "--sampler": ("sampler", str), "--pruner": ("pruner", str),
           "--seed": ("seed", int), "--study": ("study", str)}
FLAGS = {"--detach": "detach", "-d": "detach"}


def split_options(tokens: list[str]) -> tuple[list[str], TuneOptions]:
    """`pai tune` arguments: the statement (or job file and -D overrides), and the options."""
    opts, rest = TuneOptions(), []
    items = list(tokens)
    while items:
        token = items.pop(0)
        name, eq, value = token.partition("=")
        if token in FLAGS:
            setattr(opts, FLAGS[token], True)
        elif name in OPTIONS:
            if not eq:
                if not items:
                    raise UsageError(f"{name} needs a value", "see `pai tune --help`")
                value = items.pop(0)
            setattr(opts, OPTIONS[name][0], _option(name, value))
        elif token.startswith("--"):
            raise UsageError(f"unknown option {token}", "options: " + ", ".join([*OPTIONS, "--detach"]))
        else:
            rest.append(token)
    return rest, check_options(opts)


def _option(name: str, value: str) -> Any:
    kind = OPTIONS[name][1]
    if kind is int:
        try:
            return int(value)
        except ValueError:
            raise UsageError(f"{name} {value}: expected a whole number") from None
    if kind == "duration":
        try:
            return convert(Param("budget", "duration"), value, Path("."))
        except ValueError as err:
            raise UsageError(f"{name} {value}: {err}") from None
    return value


def check_options(opts: TuneOptions) -> TuneOptions:
    if not opts.space:
        raise UsageError("--space is required: the search space file", "e.g. --space space.yaml")
    for name, value, known in (("--mode", opts.mode, MODES), ("--sampler", opts.sampler, SAMPLERS),
                               ("--pruner", opts.pruner, PRUNERS)):
        if value not in known:
            raise UsageError(f"{name} {value}: expected one of {', '.join(known)}")
    if opts.trials < 1 or opts.trials > 100_000:
        raise UsageError(f"--trials {opts.trials}: expected 1 to 100000")
    if opts.parallel < 1 or opts.parallel > 512:
        raise UsageError(f"--parallel {opts.parallel}: expected 1 to 512")
    if not re.fullmatch(r"[A-Za-z0-9_./:-]+", opts.metric):
        raise UsageError(f"--metric {opts.metric!r}: expected a metric's name, e.g. loss")
    if opts.study is not None and not STUDY_NAME.fullmatch(opts.study):
        raise UsageError(f"--study {opts.study!r}: expected a word (letters, digits, _ . -)")
    return opts


def studies_dir(home: Path) -> Path:
    return home / "studies"


# -- creating a study (the `pai tune` command's library call) --------------------------------


def read_space(path: str) -> list[Dimension]:
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"--space {path}: no such file", "give the search space's YAML file") from None
    except (OSError, UnicodeDecodeError, RuntimeError) as err:
        raise UsageError(f"--space {path}: cannot read it: {getattr(err, 'strerror', None) or err}") from None
    return parse_space(text, path)


def _check_values(framework, project, base, targets, dims) -> None:
    """Each -D the space sets, at its ends and choices: a value the job's table
    refuses is bad input now, not a failed trial later."""
    for dim in dims:
        if not targets[dim.name]:
            continue
        for value in (dim.values if dim.kind == "choice" else (dim.low, dim.high)):
            params = trial_params(base, targets, {dim.name: value})
            try:
                client.prepare(statement_of_params(framework, project, params))
            except UsageError as err:
                raise UsageError(f"--space {dim.name}={format_value(value)}: {err}") from None


def create(stmt, opts: TuneOptions, store, say: Callable[[str], None] = lambda line: None) -> str:
    """Check everything, create the Optuna study and the store's row, start the tuner.
    Returns the study's name."""
    dims = read_space(opts.space)
    prepared = client.prepare(stmt)
    spec = prepared.spec
    known = {}
    for param in spec.table.values():
        known[param.name] = known[param.yaml_name] = param.name
    targets = targets_of(dims, known)
    base = dict(spec.params)
    _check_values(spec.framework, spec.project, base, targets, dims)
    trials = opts.trials
    if opts.sampler == "grid":
        size = math.prod(len(v) for v in grid_values(dims).values())
        if size < trials:
            say(f"--sampler grid: {size} points; running {size} trials")
            trials = size
    name = opts.study or f"{(spec.get('jobName') or Path(str(spec.get('script') or 'study')).stem)[:40]}" \
                         f"-{time.strftime('%Y%m%d-%H%M%S')}"
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    if not STUDY_NAME.fullmatch(name):
        name = "study-" + time.strftime("%Y%m%d-%H%M%S")
    study_dir = studies_dir(store.home) / name
    storage = opts.storage or f"sqlite:///{study_dir / 'optuna.db'}"
    config = {**asdict(opts), "trials": trials, "study": name, "storage": storage, "study_dir": str(study_dir),
              "framework": spec.framework, "project": spec.project, "base": base, "targets": targets,
              "dims": [asdict(d) for d in dims]}
    store.create_study(name, json.dumps(config, default=str))
    try:
        private_dir(studies_dir(store.home))
        private_dir(study_dir)
        write_private(study_dir / "config.json", json.dumps(config, indent=2, default=str))
        _create_optuna(config)
        start_tuner(store, name, study_dir)
    except BaseException:
        # Nothing half-written: the name is free again, the folder gone.
        store.delete_study(name)
        shutil.rmtree(study_dir, ignore_errors=True)
        raise
    return name


def _optuna():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _create_optuna(config: dict) -> None:
    optuna = _optuna()
    db = config["storage"][len("sqlite:///"):] if config["storage"].startswith("sqlite:///") else None
    try:
        if db:
            Path(db).parent.mkdir(parents=True, exist_ok=True)
        optuna.create_study(study_name=config["study"], storage=config["storage"],
                            direction="minimize" if config["mode"] == "min" else "maximize")
    except optuna.exceptions.DuplicatedStudyError:
        raise UsageError(f"--storage: a study named {config['study']} is already there",
                         "pick another --study name") from None
    except Exception as err:  # noqa: BLE001 - SQLAlchemy's many errors for a bad URL: one line
        first = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
        raise UsageError(f"--storage {config['storage']}: {first}",
                         "give a database URL Optuna accepts, e.g. sqlite:////path/study.db") from None
    if db and os.path.exists(db):
        os.chmod(db, 0o600)


def start_tuner(store, name: str, study_dir: Path) -> None:
    """The tuner in a session of its own: closing the terminal does not end the study."""
    log = os.open(study_dir / "tuner.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "paicli.tune", str(store.home), name],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True,
                                start_new_session=True, cwd=study_dir,
                                env={**os.environ, "PAI_HOME": str(store.home)})
    finally:
        os.close(log)
    store.update_study(name, tuner_pid=proc.pid, tuner_start=start_time(proc.pid))


def tuner_alive(row) -> bool:
    if not row["tuner_pid"]:
        return time.time() - (row["created"] or 0) < 30.0
    return is_alive(row["tuner_pid"], row["tuner_start"])


# -- the tuner: the study's own process ---------------------------------------------------


@dataclass
class Running:
    number: int
    trial: Any            # the Optuna trial (ask-and-tell)
    job_id: str
    after: int = 0        # the last metric rowid read
    source: tuple | None = None
    steps: set = field(default_factory=set)      # every step the job printed (any metric)
    reported: set = field(default_factory=set)   # the steps reported to Optuna
    last: tuple | None = None   # (step, value)
    best: float | None = None


class Tuner:
    """Asks Optuna, submits trials, reports their live metric, prunes, tells."""

    def __init__(self, store, name: str):
        self.store, self.name = store, name
        self.config = json.loads(store.study(name)["config"])
        self.dims = [Dimension(**{**d, "values": tuple(d["values"])}) for d in self.config["dims"]]
        self.optuna = _optuna()
        self.study = self.optuna.load_study(study_name=name, storage=self.config["storage"],
                                            sampler=self._sampler(), pruner=self._pruner())
        self.running: dict[int, Running] = {}
        self.started = 0
        self.metric_seen = False
        self.stopping = False
        self.budget_note: str | None = None
        self.completed = 0
        self.failures: list[tuple[int, str, str]] = []
        self.began = time.time()

    # Optuna's pieces from the options
    def _sampler(self):
        samplers, seed = self.optuna.samplers, self.config["seed"]
        if self.config["sampler"] == "random":
            return samplers.RandomSampler(seed=seed)
        if self.config["sampler"] == "grid":
            return samplers.GridSampler(grid_values(self.dims), seed=seed)
        return samplers.TPESampler(seed=seed, n_startup_trials=max(3, min(10, self.config["trials"] // 3)),
                                   constant_liar=self.config["parallel"] > 1)

    def _pruner(self):
        pruners = self.optuna.pruners
        return {"median": lambda: pruners.MedianPruner(n_startup_trials=median_startup(self.config["trials"])),
                "sha": pruners.SuccessiveHalvingPruner, "hyperband": pruners.HyperbandPruner,
                "none": pruners.NopPruner}[self.config["pruner"]]()

    def _distributions(self) -> dict[str, Any]:
        d = self.optuna.distributions
        out = {}
        for dim in self.dims:
            if dim.kind == "choice":
                out[dim.name] = d.CategoricalDistribution(list(dim.values))
            elif dim.kind == "int":
                out[dim.name] = d.IntDistribution(dim.low, dim.high, log=dim.log)
            else:
                out[dim.name] = d.FloatDistribution(dim.low, dim.high, log=dim.log)
        return out

    def _tell(self, trial, value: float | None = None, state=None) -> None:
        """study.tell; the grid sampler's stop request when its grid is used up is
        for Optuna's own loop (it raises in ask-and-tell, after recording the trial):
        the tuner counts its trials itself."""
        try:
            self.study.tell(trial, value, state=state)
        except RuntimeError as err:
            if "Study.stop" not in str(err):
                raise

    # the loop
    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        try:
            while True:
                self.look()
                if self.stopping:
                    self.cancel_all("study stopped")
                    self.end("Cancelled", "stopped by the user", 130)
                    return
                self.start_more()
                if not self.running and not self.may_start():
                    self.finish()
                    return
                time.sleep(POLL)
        except PaiError as err:
            self.cancel_all(f"study failed: {err}")
            self.end("Failed", str(err), err.exit_code)
        except BaseException as err:
            self.cancel_all("study failed")
            self.end("Failed", f"tuner error: {type(err).__name__}: {err}", 1)
            raise

    def may_start(self) -> bool:
        return not self.stopping and self.started < self.config["trials"] and self.budget_note is None

    def start_more(self) -> None:
        while len(self.running) < self.config["parallel"] and self.may_start():
            if not self._budget_ok():
                return
            self.start_trial()

    def _budget_ok(self) -> bool:
        budget = self.config["budget"]
        if budget is None:
            return True
        forecast = trial_forecast(*self._forecast_inputs())
        elapsed = time.time() - self.began
        if budget_allows(elapsed, budget, forecast):
            return True
        self.budget_note = (f"budget: {self.started} trials started; another (forecast {forecast or 0:.0f}s) "
                            f"would pass --budget {budget:g}s ({max(budget - elapsed, 0):.0f}s left)")
        self.store.update_study(self.name, note=self.budget_note)
        return False

    def _forecast_inputs(self) -> tuple[list[float], float | None, int | None]:
        seconds, steps, pluto = [], None, None
        for row in self.store.study_trials(self.name):
            if row["state"] != "Complete" or not row["job_id"]:
                continue
            job = self.store.job(row["job_id"])
            if job["started"] and job["ended"]:
                seconds.append(job["ended"] - job["created"])
            if row["step"] is not None:
                steps = max(steps or 0, int(row["step"]))
            forecast = (record(job["job_dir"]) or {}).get("forecast_step_s")
            pluto = forecast or pluto
        return seconds, pluto, steps

    def start_trial(self) -> None:
        trial = self.study.ask(self._distributions())
        number = trial.number
        params = trial_params(self.config["base"], self.config["targets"], trial.params)
        params["jobName"] = f"{self.name}.{number}"
        self.started += 1
        self.store.put_trial(self.name, number, params=json.dumps(trial.params), state="Waiting")
        stmt = statement_of_params(self.config["framework"], self.config["project"], params)
        prepared = client.prepare(stmt)
        if prepared.spec.get("autoStrategy") == "true":
            prepared = auto_strategy(prepared, self.store, self.say)
        try:
            job_id = client.submit(prepared, self.store, progress=self.say)
        except PaiError as err:
            self._tell(trial, state=self.optuna.trial.TrialState.FAIL)
            self.store.put_trial(self.name, number, state="Failed", reason=str(err), ended=time.time())
            raise
        self.running[number] = Running(number, trial, job_id)
        self.store.put_trial(self.name, number, job_id=job_id)
        self.say(f"trial {number}: job {job_id} {trial.params}")

    def look(self) -> None:
        for run in list(self.running.values()):
            job = client.refresh(self.store, run.job_id)
            over = job["status"] in ("Succeeded", "Failed", "Cancelled")
            if job["status"] == "Running" and run.last is None:
                self.store.put_trial(self.name, run.number, state="Running")
            if self._read_metric(run, judge=not over):
                self.prune(run)
            elif over:
                self.ended(run, job)

    def _read_metric(self, run: Running, judge: bool = False) -> bool:
        """Report the metric's new steps; with `judge`, ask the pruner after each
        one, as an objective's own loop would. True: prune now (nothing after that
        step is reported)."""
        rows = self.store.metrics_after(run.job_id, run.after)
        if not rows:
            return False
        run.after = rows[-1]["rowid"]
        run.steps |= {r["step"] for r in rows if r["step"] is not None}
        run.source, points = pick_series([(r["role"], r["idx"], r["step"], r["key"], r["value"]) for r in rows],
                                         self.config["metric"], run.source)
        prune = False
        for step, value in points:
            if step in run.reported:
                continue   # Optuna keeps a step's first value
            run.trial.report(value, step)
            run.reported.add(step)
            run.last = (step, value)
            run.best = value if better(value, run.best, self.config["mode"]) else run.best
            if judge and run.trial.should_prune():
                prune = True
                break
        if points:
            self.metric_seen = True
            self.store.put_trial(self.name, run.number, state="Running", step=run.last[0], value=run.last[1],
                                 best=run.best)
        elif missing_metric(len(run.steps), self.metric_seen, False):
            self._missing(run)
        return prune

    def _missing(self, run: Running) -> None:
        keys = sorted({r["key"] for r in self.store.latest_metrics(run.job_id)} - set(STEP_KEYS))
        printed = f"it printed {', '.join(keys)}" if keys else "it printed no metric lines"
        raise UsageError(f"--metric {self.config['metric']}: trial {run.number} printed no "
                         f"{self.config['metric']} ({printed})",
                         "pick one of those with --metric" if keys else "print lines such as `step=3, loss=0.25`")

    def prune(self, run: Running) -> None:
        step = run.last[0]
        client.kill(self.store, run.job_id, reason=f"pruned by pai tune (study {self.name}, trial {run.number}, "
                                                   f"step {step})", wait=5.0)
        self._tell(run.trial, state=self.optuna.trial.TrialState.PRUNED)
        self.store.put_trial(self.name, run.number, state="Pruned", reason=f"at step {step}", ended=time.time())
        del self.running[run.number]
        self.say(f"trial {run.number}: pruned at step {step}")

    def ended(self, run: Running, job) -> None:
        TrialState = self.optuna.trial.TrialState
        self._read_metric(run)   # what it printed last
        del self.running[run.number]
        if job["status"] == "Succeeded" and run.last is not None:
            self.completed += 1
            self._tell(run.trial, run.last[1])
            self.store.put_trial(self.name, run.number, state="Complete", value=run.last[1], ended=time.time())
            return
        if job["status"] == "Succeeded" and missing_metric(len(run.steps), self.metric_seen, True):
            self._tell(run.trial, state=TrialState.FAIL)
            self.store.put_trial(self.name, run.number, state="Failed", reason="no metric", ended=time.time())
            self._missing(run)
        self._tell(run.trial, state=TrialState.FAIL)
        state = "Cancelled" if job["status"] == "Cancelled" else "Failed"
        reason = job["reason"] or (f"printed no {self.config['metric']}" if job["status"] == "Succeeded" else "")
        self.store.put_trial(self.name, run.number, state=state, reason=reason, ended=time.time())
        self.failures.append((run.number, run.job_id, reason))
        if give_up(len(self.failures), self.completed):
            number, job_id, why = self.failures[0]
            raise PaiError(f"the first {len(self.failures)} trials failed (trial {number}: {why})"[:300],
                           f"see `pai logs {job_id}`")

    def cancel_all(self, reason: str) -> None:
        for run in list(self.running.values()):
            try:
                client.kill(self.store, run.job_id, reason=reason)
                self._tell(run.trial, state=self.optuna.trial.TrialState.FAIL)
            except Exception as err:  # noqa: BLE001 - one trial's trouble must not keep the others running
                self.say(f"trial {run.number}: {err}")
            self.store.put_trial(self.name, run.number, state="Cancelled", reason=reason, ended=time.time())
        self.running.clear()

    def finish(self) -> None:
        best = best_of([r for r in self.store.study_trials(self.name) if r["state"] == "Complete"],
                       self.config["mode"])
        if best is None:
            self.end("Failed", "no trial completed", 1)
            return
        params = trial_params(self.config["base"], self.config["targets"], json.loads(best["params"]))
        self.end("Succeeded", None, 0, best_trial=best["number"],
                 rerun=rerun_command(self.config["framework"], self.config["project"], params))

    def end(self, status: str, reason: str | None, code: int, **fields) -> None:
        self.store.end_study(self.name, status, reason, code, **fields)
        self.say(f"study {self.name}: {status}" + (f": {reason}" if reason else ""))

    @staticmethod
    def say(line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)


# -- reading a study (no Optuna: the store only) ----------------------------------------------


def study_view(store, name: str) -> dict[str, Any]:
    """A study as `pai tune status` and the logview show it."""
    row = store.study(name)
    config = json.loads(row["config"])
    status, reason = row["status"], row["reason"]
    if status == "Running" and not tuner_alive(row):
        row = store.study(name)   # it may have recorded its end just now
        status, reason = row["status"], row["reason"]
        if status == "Running":
            status, reason = "Failed", "its tuner is gone (stopped or killed)"
    trials = [{"number": t["number"], "job_id": t["job_id"], "state": t["state"], "reason": t["reason"],
               "params": json.loads(t["params"]) if t["params"] else {}, "step": t["step"],
               "value": t["value"], "best": t["best"]} for t in store.study_trials(name)]
    best = best_of([t for t in trials if t["state"] == "Complete"], config["mode"])
    return {"name": name, "status": status, "reason": reason, "code": row["code"], "note": row["note"],
            "metric": config["metric"], "mode": config["mode"], "trials_planned": config["trials"],
            "parallel": config["parallel"], "sampler": config["sampler"], "pruner": config["pruner"],
            "storage": config["storage"], "created": row["created"], "ended": row["ended"],
            "trials": trials, "best": best, "rerun": row["rerun"],
            "pruned": sum(t["state"] == "Pruned" for t in trials), "over": status != "Running"}


def stop(store, name: str) -> bool:
    """Ask a study's tuner to stop (it cancels its running trials); False if it is not running."""
    row = store.study(name)
    if row["status"] != "Running" or not row["tuner_pid"]:
        return False
    return signal_verified(row["tuner_pid"], row["tuner_start"], signal.SIGTERM)


def main(argv: list[str]) -> int:
    home, name = Path(argv[0]), argv[1]
    # Each trial's master is a fresh interpreter (cluster/spawn.py): a fork of this
    # process would carry Optuna, numpy and SQLAlchemy's open connections.
    os.environ["PAI_MASTER_EXEC"] = "1"
    store = Store(home)
    Tuner(store, name).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
