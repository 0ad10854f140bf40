"""Render a study as Slurm batch scripts: one job per stage, chained with ``--dependency=afterok``.

    launch = load_launch("launch.yaml")                  # partition, nodes, GPUs, container or venv, ...
    for job in plan(study, launch): print(job.script)    # what `megaopd submit --dry-run` shows

The scripts are copies of the hand-editable templates in ``slurm/`` (``stage.sbatch`` for one node,
``stage_multinode.sbatch`` for torchrun on many nodes plus SGLang rollout/teacher servers) with their
``#SBATCH`` block and settings block filled in, so a rendered script reads like the template a user would edit.
A stage depends on the stages whose run directories its overrides name (``{out}/<stage>/...``); stages that do
not depend on each other (per-domain experts, say) are queued at the same time. Finished stages are skipped,
as in ``megaopd study``. Before the stages an ``assets`` job builds the embedded models and data (when the study
has any), and after them a ``report`` job writes ``{out}/report.txt`` (accuracy vs FLOPs) and ``{out}/report/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from megaopd.accounting.flops import HF_CONFIG
from megaopd.config import (ConfigError, RunConfig, check_at_least, check_range, from_dict, load_config, read_under,
                            save_config, setting, to_dict)
from megaopd.launch.server_tp import server_tp
from megaopd.objectives.methods import method
from megaopd.run.resolve import resolve_stage
from megaopd.run.study import (StageConfig, StudyConfig, dependencies, seed_studies, stage_config, stage_finished,
                           stage_overrides, submission_order)

# The templates live beside the package in a source checkout (also the layout inside the Docker images).
TEMPLATES = Path(__file__).resolve().parents[2] / "slurm"
SINGLE_NODE = "stage.sbatch"
MULTI_NODE = "stage_multinode.sbatch"


@dataclass
class LaunchConfig:
    """Where and how the study's jobs run. Every field may be changed per stage under ``stages``."""

    partition: str = ""
    account: str = ""
    qos: str = ""
    time: str = "04:00:00"
    nodes: int = 1  # trainer nodes; more than one (or more than one GPU) runs torchrun on each
    gpus_per_node: int = 0  # 0: CPU only, the embedded default
    cpus_per_task: int = 0  # 0: the partition's default
    mem: str = ""  # e.g. "200G"; empty: the partition's default
    rollout_nodes: int = 0  # nodes serving the student with SGLang for GRPO/OPD stages (0: rollouts in-process)
    teacher_servers: bool = False  # OPD stages: one SGLang node per teacher (False: teachers in-process)
    container_image: str = ""  # pyxis/enroot image for the job steps; empty: the host's Python (see venv)
    container_mounts: list[str] = field(default_factory=list)  # src:dst beyond the checkout and {out}
    venv: str = ""  # a virtual environment activated in each job
    workdir: str = ""  # the megaopd checkout the jobs run in; empty: the current directory
    signal_seconds: int = 120  # SIGUSR1 this long before the time limit: the time to finish a step + checkpoint
    max_requeues: int = 20
    sglang_port: int = 30000
    master_port: int = 29500
    # The multi-node script's parts a site may need to change (docs/cluster.md, "Site settings").
    trainer_module: str = "megaopd.models.megatron.launch"  # torchrun -m this on each trainer node
    sglang_python: str = ""  # the Python of SGLang's environment on the server nodes; empty: the job's `python`
    sglang_args: list[str] = field(default_factory=list)  # more sglang.launch_server flags
    sglang_env: dict[str, str] = field(default_factory=dict)  # more environment of the servers
    sglang_tp: int = 0  # each server's tensor-parallel size; 0: the node's GPUs (checked against the heads)
    server_start_timeout_s: int = 1200  # how long the job waits for every server's /health
    # Network and CPUs of the job steps (docs/cluster.md, "Network and CPUs").
    socket_ifname: str = ""  # NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, e.g. "ib0"; empty: NCCL and Gloo pick
    ib_hca: str = ""  # NCCL_IB_HCA, e.g. "mlx5_0,mlx5_1"; empty: NCCL's choice
    cpu_bind: str = ""  # srun --cpu-bind of the trainer and server steps, e.g. "none"; empty: the site's default
    overrides: list[str] = field(default_factory=list)  # config overrides for every stage, e.g. model.device=cuda
    sbatch: list[str] = field(default_factory=list)  # more #SBATCH options, e.g. "--constraint=h100"
    setup: list[str] = field(default_factory=list)  # shell lines run first in each job, e.g. "module load cuda"
    stages: dict[str, dict] = field(default_factory=dict)  # stage name -> fields that differ for that stage

    def __post_init__(self):
        # sbatch refuses each of these only once the jobs before it are queued, or the job script misreads it
        if time_limit_seconds(self.time) is None:
            raise ConfigError(f"{setting('', 'time')}={self.time!r} is not a Slurm time limit; write "
                              "hours:minutes:seconds (e.g. 08:00:00), days-hours[:minutes[:seconds]], "
                              "minutes[:seconds], or 0 for none")
        check_at_least("", self, 1, "nodes", "server_start_timeout_s")
        check_range("", self, "gpus_per_node", 0, means="0: CPU only")
        check_range("", self, "cpus_per_task", 0, means="0: the partition's default")
        check_range("", self, "rollout_nodes", 0, means="0: rollouts in-process")
        check_range("", self, "signal_seconds", 0, 65535)  # sbatch --signal's range
        check_range("", self, "max_requeues", 0, means="0: a preempted job ends")
        for name in ("sglang_port", "master_port"):
            check_range("", self, name, 1, 65535)
        check_range("", self, "sglang_tp", 0, means="0: the node's GPUs")


@dataclass
class Job:
    name: str
    script: str
    after: list[str] = field(default_factory=list)  # jobs (by name) that must end successfully first


# sbatch --time's forms: days-hours[:minutes[:seconds]], else minutes, minutes:seconds or hours:minutes:seconds
_DAYS_TIME = re.compile(r"(\d+)-(\d+)(?::(\d+))?(?::(\d+))?")
_TIME = re.compile(r"(\d+)(?::(\d+))?(?::(\d+))?")


def time_limit_seconds(time: str) -> float | None:
    """The seconds of a Slurm time limit (inf: none, as 0, INFINITE and UNLIMITED ask), None for one sbatch refuses."""
    if time.lower() in ("infinite", "unlimited"):
        return math.inf
    if days := _DAYS_TIME.fullmatch(time):
        d, h, m, s = (int(part or 0) for part in days.groups())
    elif plain := _TIME.fullmatch(time):
        parts = [int(part) for part in plain.groups() if part is not None]
        d, (h, m, s) = 0, (parts if len(parts) == 3 else (0, *parts, 0)[:3])
    else:
        return None
    return ((d * 24 + h) * 60 + m) * 60 + s or math.inf


def load_launch(path: str | Path | None, overrides: list[str] = ()) -> LaunchConfig:
    return load_config(path, overrides, cls=LaunchConfig)


def add_study_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments `megaopd submit` and `megaopd rehearse` share: STUDY [key=value ...] [--launch L] [--set K=V]."""
    parser.add_argument("config", help="the study YAML")
    parser.add_argument("overrides", nargs="*", help="study overrides, key.sub=value")
    parser.add_argument("--launch", help="launch YAML (partition, nodes, GPUs, container or venv, ...)")
    parser.add_argument("--set", dest="launch_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="launch override, e.g. --set partition=gpu (repeatable)")


def study_and_launch(args: argparse.Namespace) -> tuple[StudyConfig, LaunchConfig]:
    """The study (its paths made absolute) and the launch config that ``add_study_arguments`` parsed."""
    study = absolute_study(load_config(args.config, args.overrides, cls=StudyConfig))
    return study, load_launch(args.launch, args.launch_overrides)


def for_stage(launch: LaunchConfig, stage: str) -> LaunchConfig:
    """The launch config with the stage's own fields (``stages.<name>``) applied; a refusal names the stage's."""
    where = f"stages.{stage}."
    with read_under(where):  # the launch's own fields were checked as it loaded: a refusal here is the stage's
        return from_dict(LaunchConfig, to_dict(launch) | {"stages": {}} | launch.stages.get(stage, {}), where)


def absolute_study(study: StudyConfig) -> StudyConfig:
    """The study with ``out`` and stage config paths made absolute (jobs start in the checkout, not here)."""
    stages = [dataclasses.replace(s, config=str(Path(s.config).resolve()) if s.config else "")
              for s in study.stages]
    return dataclasses.replace(study, out=str(Path(study.out).resolve()), stages=stages)


def plan(study: StudyConfig, launch: LaunchConfig) -> list[Job]:
    """The jobs to submit, in submission order; ``study`` must be absolute (see ``absolute_study``).

    With ``seeds``, each seed's jobs run the study in {out}/seed_<s> (names prefixed ``seed_<s>.``) and one report
    job covers them all, as ``megaopd study`` does in one process; a ``shared`` stage is the first seed's job only,
    which the later seeds' jobs wait for (``submit`` links their run directories to it).
    """
    shared = {stage.name for stage in study.stages if stage.shared} if study.seeds else set()
    seeds, jobs = seed_studies(study), []
    for one in seeds:
        prefix, first = (f"seed_{one.seed}.", f"seed_{seeds[0].seed}.") if study.seeds else ("", "")
        for job in stage_jobs(one, launch):
            if job.name in shared and one is not seeds[0]:
                continue  # one job, the first seed's, makes it for every seed
            queued = {j.name for j in jobs}  # a shared stage already done has no job to wait for
            after = [(first if name in shared else prefix) + name for name in job.after]
            jobs.append(Job(prefix + job.name, job.script, [name for name in after if name in queued]))
    jobs.append(Job("report", render_job(study, "report", launch, "report"), [job.name for job in jobs]))
    return jobs


def stage_jobs(study: StudyConfig, launch: LaunchConfig) -> list[Job]:
    """The assets job (when the study builds any) and every stage not finished yet (under the step cap its job would
    train to), upstream stages first."""
    deps = dependencies(study)
    stages = {s.name: s for s in study.stages}
    todo = [n for n in submission_order(study)
            if not stage_finished(study, stages[n], for_stage(launch, n).overrides)]
    jobs = []
    has_assets = bool(study.assets.presets or study.assets.domains)
    if has_assets and todo:
        jobs.append(Job("assets", render_job(study, "assets", launch, "assets")))
    for name in todo:
        after = (["assets"] if has_assets else []) + [d for d in deps[name] if d in todo]
        jobs.append(Job(name, render_stage(study, stages[name], for_stage(launch, name)), after))
    return jobs


def study_file(study: StudyConfig) -> Path:
    """Where `megaopd submit` saves the (absolute) study for the assets and report jobs."""
    return Path(study.out) / "slurm" / "study.yaml"


def launch_file(study: StudyConfig) -> Path:
    """Where `megaopd submit` saves the launch config for the report job (each stage's config is its job's)."""
    return Path(study.out) / "slurm" / "launch.yaml"


def write_job_inputs(study: StudyConfig, launch: LaunchConfig) -> None:
    """What the jobs read beside their scripts: the study (each seed's too, for its assets job) and the launch
    config, and the directory of their logs (sbatch does not create --output's)."""
    for one in [study, *(seed_studies(study) if study.seeds else [])]:
        (Path(one.out) / "slurm" / "logs").mkdir(parents=True, exist_ok=True)
        save_config(one, study_file(one))
    save_config(launch, launch_file(study))


def render_job(study: StudyConfig, name: str, launch: LaunchConfig, action: str) -> str:
    """A one-node job running ``python -m megaopd.launch.jobs <action> STUDY`` (assets, or report with the launch
    config)."""
    small = dataclasses.replace(launch, nodes=1, gpus_per_node=0, time="00:30:00")
    cmd = ["python", "-m", "megaopd.launch.jobs", action, str(study_file(study))]
    if action == "report":
        cmd += ["--launch", str(launch_file(study))]
    return _render(SINGLE_NODE, _sbatch_lines(study, name, small, nodes=1), _settings(study, small, cmd))


def render_stage(study: StudyConfig, stage: StageConfig, launch: LaunchConfig) -> str:
    """The batch script of one stage; ``launch`` is already the stage's own (see ``for_stage``)."""
    limit = time_limit_seconds(launch.time)
    if launch.signal_seconds >= limit:
        raise ConfigError(f"stage {stage.name}: signal_seconds={launch.signal_seconds} is not below its time limit "
                          f"{launch.time} ({limit:.0f} s): its job would checkpoint and requeue as it starts; lower "
                          "signal_seconds or raise time")
    args = stage_overrides(study, stage) + launch.overrides
    cfg = stage_config(study, stage, launch.overrides)  # fails here, not in the queue
    spec = method(cfg.train.algorithm)
    rollout_nodes = launch.rollout_nodes if spec.rollouts else 0
    teachers = sorted(spec.teachers(cfg.opd).items()) if launch.teacher_servers else []
    # The servers the job starts (the trainer finds the teachers' by route in MEGAOPD_TEACHER_URLS).
    served = ["rollout.engine=sglang"] * bool(rollout_nodes) + ["opd.teacher_engine=sglang"] * bool(teachers)
    args += served
    # What the job's `megaopd train` would refuse, refused before anything is queued, in its line
    resolve_stage(stage_config(study, stage, [*launch.overrides, *served]), stage.name,
                  " (or launch teacher_servers=false: in-process teachers)" if teachers else "")
    train_args = [stage.config, *args, f"run_dir={study.out}/{stage.name}"]

    # The megatron backend always runs under torchrun (megaopd.models.megatron.launch), even on one GPU.
    multi = (launch.nodes > 1 or launch.gpus_per_node > 1 or rollout_nodes or teachers
             or cfg.model.backend == "megatron")
    if not multi:
        cmd = ["python", "-m", "megaopd.cli", "train", *train_args]
        return _render(SINGLE_NODE, _sbatch_lines(study, stage.name, launch, nodes=1),
                       _settings(study, launch, cmd))
    _check_distributed(cfg, launch, stage.name)
    _check_servers(launch, stage.name, [cfg.model.path] * bool(rollout_nodes) + [path for _, path in teachers])
    return render_multinode(study, stage.name, launch, train_args, rollout_nodes, cfg.model.path, teachers,
                            cfg.model.dtype, cfg.rollout.sglang.max_total_tokens)


def render_multinode(study: StudyConfig, name: str, launch: LaunchConfig, train_args: list[str], rollout_nodes: int,
                     rollout_model: str, teachers: list[tuple[str, str]], dtype: str, max_total_tokens: int) -> str:
    """slurm/stage_multinode.sbatch for one job: ``launch.nodes`` trainer nodes running ``torchrun -m
    launch.trainer_module *train_args``, then `rollout_nodes` SGLang servers of `rollout_model` and one per
    (route, model) in `teachers`, each on its own node (a stage's job, or a benchmark's: bench/async_rollout.py)."""
    nodes = launch.nodes + rollout_nodes + len(teachers)
    # The servers load the model in the trainer's dtype (the weight-sync probe compares their logprobs).
    sglang_args = ["--dtype", dtype, *(["--max-total-tokens", str(max_total_tokens)] if max_total_tokens else []),
                   *launch.sglang_args]
    settings = _settings(study, launch, None) + [
        f"TRAIN_NODES={launch.nodes}",
        f"GPUS_PER_NODE={launch.gpus_per_node}",
        f"TRAINER_MODULE={launch.trainer_module}",
        f"ROLLOUT_NODES={rollout_nodes}",
        f"ROLLOUT_MODEL={shlex.quote(rollout_model)}",
        f"TEACHERS=({' '.join(shlex.quote(f'{route}={path}') for route, path in teachers)})",
        f"SGLANG_PYTHON={shlex.quote(launch.sglang_python or 'python')}",
        f"SGLANG_TP={launch.sglang_tp}",
        f"SGLANG_ARGS=({shlex.join(sglang_args)})",
        f"SGLANG_ENV=({' '.join(shlex.quote(f'{k}={v}') for k, v in launch.sglang_env.items())})",
        f"SGLANG_PORT={launch.sglang_port}",
        f"SERVER_START_TIMEOUT={launch.server_start_timeout_s}",
        f"MASTER_PORT={launch.master_port}",
        f"SIGNAL_SECONDS={launch.signal_seconds}",
        f"TRAIN_ARGS=({shlex.join(train_args)})",
    ]
    return _render(MULTI_NODE, _sbatch_lines(study, name, launch, nodes, exclusive=True), settings + launch.setup)


def _check_distributed(cfg: RunConfig, launch: LaunchConfig, stage: str) -> None:
    if launch.gpus_per_node < 1:
        raise ConfigError(f"stage {stage}: more than one node, or SGLang servers, need gpus_per_node >= 1")
    if cfg.model.backend == "hf" and launch.nodes * launch.gpus_per_node > 1:
        raise ConfigError(f"stage {stage}: the hf backend trains in one process; use model.backend=megatron "
                          f"for {launch.nodes} node(s) x {launch.gpus_per_node} GPU(s)")


def _check_servers(launch: LaunchConfig, stage: str, models: list[str]) -> None:
    """Refuse at submission what the job would refuse later: a bad entry point, heads that do not split over the
    servers' tensor-parallel size (for the models that exist already; the job checks the others)."""
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", launch.trainer_module):
        raise ConfigError(f"stage {stage}: trainer_module={launch.trainer_module!r} is not a module name "
                          "(e.g. megaopd.models.megatron.launch)")
    for model in models:
        if (Path(model) / HF_CONFIG).exists():
            try:
                server_tp(model, launch.gpus_per_node, launch.sglang_tp)
            except ValueError as e:
                raise ConfigError(f"stage {stage}: {e}") from None


def _sbatch_lines(study: StudyConfig, name: str, launch: LaunchConfig, nodes: int,
                  exclusive: bool = False) -> list[str]:
    options = [f"--job-name=megaopd-{Path(study.out).name}-{name}"]
    options += [f"--{key}={value}" for key, value in
                (("partition", launch.partition), ("account", launch.account), ("qos", launch.qos)) if value]
    options += [f"--nodes={nodes}", "--ntasks-per-node=1"]
    if launch.cpus_per_task:
        options.append(f"--cpus-per-task={launch.cpus_per_task}")
    if launch.gpus_per_node:
        options.append(f"--gpus-per-node={launch.gpus_per_node}")
    if launch.mem:
        options.append(f"--mem={launch.mem}")
    if exclusive:
        options.append("--exclusive")
    options += [f"--time={launch.time}",
                f"--signal=B:USR1@{launch.signal_seconds}",  # to this script, which forwards it (slurm/lib.sh)
                "--requeue", "--open-mode=append",  # a requeued job appends to the same log
                f"--output={study.out}/slurm/logs/%x-%j.out",
                f"--chdir={_workdir(launch)}", *launch.sbatch]
    return [f"#SBATCH {o}" for o in options]


def _workdir(launch: LaunchConfig) -> str:
    return str(Path(launch.workdir or ".").resolve())


def _settings(study: StudyConfig, launch: LaunchConfig, cmd: list[str] | None) -> list[str]:
    mounts = ",".join([f"{study.out}:{study.out}", *launch.container_mounts])
    # Gloo takes interface names only, not NCCL's "^docker" (exclude) or "=eth0" (exact) forms.
    if launch.socket_ifname and not re.fullmatch(r"[\w.:-]+(,[\w.:-]+)*", launch.socket_ifname):
        raise ConfigError(f"socket_ifname={launch.socket_ifname!r}: give interface names, comma-separated (e.g. ib0 "
                          "or eth0,eth1); NCCL's ^/= forms do not work for Gloo")
    lines = [f"WORKDIR={shlex.quote(_workdir(launch))}",
             f"VENV={shlex.quote(launch.venv)}",
             f"CONTAINER_IMAGE={shlex.quote(launch.container_image)}",
             f"CONTAINER_MOUNTS={shlex.quote(mounts if launch.container_image else '')}",
             f"MAX_REQUEUES={launch.max_requeues}",
             f"SOCKET_IFNAME={shlex.quote(launch.socket_ifname)}",
             f"IB_HCA={shlex.quote(launch.ib_hca)}",
             f"CPU_BIND={shlex.quote(launch.cpu_bind)}"]
    if cmd is not None:  # the single-node template runs CMD; the multi-node one builds torchrun from TRAIN_ARGS
        lines += [f"CMD=({shlex.join(cmd)})", *launch.setup]
    return lines


def _render(template: str, sbatch: list[str], settings: list[str]) -> str:
    path = TEMPLATES / template
    if not path.exists():
        raise FileNotFoundError(f"{path}: the slurm/ templates come with a megaopd source checkout")
    text = path.read_text()
    for block, lines in (("sbatch", sbatch), ("settings", settings)):
        pattern = re.compile(rf"(# >>> megaopd:{block}\n).*?(# <<< megaopd:{block}\n)", re.S)
        text, n = pattern.subn(lambda m: m[1] + "".join(line + "\n" for line in lines) + m[2], text)
        if n != 1:
            raise ValueError(f"{path}: no '# >>> megaopd:{block}' ... '# <<< megaopd:{block}' block")
    return text
