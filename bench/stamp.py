"""What every raw benchmark file starts with: the command, the commit of the tree it ran from (and
whether that tree had uncommitted changes), the CPU model and the ISA extensions the kernels choose
between, and the time. Import it from the bench scripts: `from stamp import stamp`."""
import os, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args):
    try:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def stamp():
    model, flags, family, cpu_model = "unknown", set(), "?", "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("cpu family") and family == "?":
                    family = line.split(":", 1)[1].strip()
                elif line.split(":", 1)[0].strip() == "model" and cpu_model == "?":
                    cpu_model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [x for x in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512vnni", "avx_vnni") if x in flags]
    return {
        "command": " ".join(sys.argv),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        # "AMD EPYC" alone names no generation: family and model do (26/2 is Zen 5, 25/1 Zen 3).
        "cpu": f"{model} (family {family}, model {cpu_model})",
        "isa": isa,
        "cpus": os.cpu_count(),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
