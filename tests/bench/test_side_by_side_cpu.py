"""The side-by-side harness's CPU awareness: /proc/cpuinfo parsing, llama.cpp's cmake ISA flags and build
folder, the SIGILL check, core's two rows and the report's CPU line and per-core-row ratio tables.

No network, builds or servers: cpuinfo texts are fixtures, "binaries" are tiny shell scripts.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import side_by_side  # noqa: E402
from peers import core_server, cpu, llama_cpp_python, llamacpp, vllm  # noqa: E402
from peers.common import SetupError  # noqa: E402
from peers.cpu import Cpu, parse_cpu  # noqa: E402
from peers.peer import Context  # noqa: E402
from peers.report import Row, markdown, ratio_tables, write_json  # noqa: E402

# an AVX2-only AMD (Zen 3): no AVX-512, no VNNI, no AMX
AMD_CPUINFO = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse \
sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid \
extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes \
xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch \
osvw topoext invpcid_single ssbd ibrs ibpb stibp vmmcall fsgsbase bmi1 avx2 smep bmi2 erms invpcid \
rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves clzero xsaveerptr rdpru arat \
npt nrip_save umip vaes vpclmulqdq rdpid fsrm
bugs\t\t: sysret_ss_attrs null_seg spectre_v1 spectre_v2 spec_store_bypass srso

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: some other CPU that must not be read
flags\t\t: avx512f avx512cd avx512bw avx512vl avx512dq amx_tile
"""

# a Sapphire Rapids Xeon: the five AVX-512 subsets, AVX512-BF16/VNNI, AVX-VNNI, AMX; avx512_vbmi2 and
# avx512ifma but (unlike the real one) not avx512vbmi, so GGML_AVX512_VBMI must come out OFF
INTEL_FLAGS = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
               "sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc arch_perfmon rep_good nopl xtopology "
               "nonstop_tsc cpuid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic "
               "movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm abm "
               "3dnowprefetch invpcid_single ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 "
               "avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb "
               "avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 "
               "wbnoinvd arat avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg "
               "avx512_vpopcntdq la57 rdpid cldemote movdiri movdir64b fsrm md_clear serialize tsxldtrk "
               "amx_bf16 avx512_fp16 amx_tile amx_int8 arch_capabilities")
INTEL_CPUINFO = f"""\
processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
stepping\t: 8
flags\t\t: {INTEL_FLAGS}
"""

AVX2_ONLY_ISA = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2")
INTEL_ISA = (*AVX2_ONLY_ISA, "avx_vnni", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")

AMX_OFF = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
AMD_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF",
             "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", *AMX_OFF]
INTEL_FLAGS_CMAKE = ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
                     "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=ON",
                     "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=ON",
                     "-DGGML_AVX512_BF16=ON", *AMX_OFF]
AVX512_SUBSETS = ("avx512f", "avx512cd", "avx512bw", "avx512vl", "avx512dq")

GGUF = Path("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
LEVELS = [1, 8]


def x86(text: str, cores: int = 2, torch_capability: str | None = None) -> Cpu:
    """The parsed CPU, as an x86_64 machine whatever this host is (parse_cpu takes the host's machine)."""
    return dataclasses.replace(parse_cpu(text, cores, torch_capability), machine="x86_64")


def without(text: str, *flags: str) -> str:
    """`text` with whole flags removed from its flags line."""
    lines = []
    for line in text.splitlines():
        if line.startswith("flags"):
            key, _, value = line.partition(":")
            line = f"{key}: " + " ".join(f for f in value.split() if f not in flags)
        lines.append(line)
    return "\n".join(lines) + "\n"


def flag(flags: list[str], option: str) -> str:
    """The value ("ON"/"OFF") of `-D{option}=...` in `flags`; fails if it is missing or repeated."""
    values = [f.split("=", 1)[1] for f in flags if f.split("=", 1)[0] == f"-D{option}"]
    assert len(values) == 1, (option, flags)
    return values[0]


# --- /proc/cpuinfo ---------------------------------------------------------------------------------------


def test_amd_avx2_cpuinfo_parses_model_vendor_cores_and_only_the_first_processor():
    amd = parse_cpu(AMD_CPUINFO, cores=4, torch_capability="AVX2")
    assert amd.model == "AMD EPYC 7763 64-Core Processor"
    assert amd.vendor == "AuthenticAMD"
    assert amd.cores == 4 and amd.torch_capability == "AVX2"
    assert amd.isa == AVX2_ONLY_ISA  # processor 1's avx512/amx flags are not read
    assert not amd.has("avx512f") and not amd.has("amx_tile") and amd.has("avx2", "fma")


def test_intel_xeon_cpuinfo_keeps_the_isa_flags_in_isa_flags_order():
    intel = parse_cpu(INTEL_CPUINFO, cores=8, torch_capability=None)
    assert intel.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert intel.vendor == "GenuineIntel" and intel.cores == 8
    assert intel.isa == INTEL_ISA
    assert "avx512vbmi" not in intel.isa  # only avx512_vbmi2 (and avx512ifma) are there
    assert intel.has(*AVX512_SUBSETS, "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile")
    assert not intel.has("avx512f", "amx_fp16")


def test_empty_or_flagless_cpuinfo_gives_an_unknown_cpu():
    empty = parse_cpu("", cores=1, torch_capability=None)
    assert (empty.model, empty.vendor, empty.isa) == ("unknown CPU", "unknown", ())
    arm = parse_cpu("processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32\n", 1, None)
    assert arm.isa == ()


def test_cpu_line_names_model_vendor_cores_isa_amx_and_torch():
    intel = x86(INTEL_CPUINFO, cores=8, torch_capability="AVX512")
    assert intel.line() == ("CPU: Intel(R) Xeon(R) Platinum 8480+ (GenuineIntel, x86_64), 8 cores; "
                            f"ISA: {' '.join(INTEL_ISA)}; AMX: yes; torch CPU capability: AVX512")
    amd = x86(AMD_CPUINFO)
    assert amd.line() == ("CPU: AMD EPYC 7763 64-Core Processor (AuthenticAMD, x86_64), 2 cores; "
                          "ISA: sse4_2 avx avx2 fma f16c bmi2; AMX: none; torch CPU capability: unknown")


def test_busy_fraction_is_busy_ticks_over_total_ticks(monkeypatch):
    ticks = iter([(100, 1000), (175, 1100)])
    monkeypatch.setattr(cpu, "_cpu_ticks", lambda: next(ticks))
    assert cpu.busy_fraction(seconds=0) == pytest.approx(0.75)

    def unreadable():
        raise OSError("no /proc/stat")

    monkeypatch.setattr(cpu, "_cpu_ticks", unreadable)
    assert cpu.busy_fraction(seconds=0) is None


def test_cpu_ticks_reads_proc_stat():
    if not Path("/proc/stat").is_file():
        pytest.skip("no /proc/stat")
    busy, total = cpu._cpu_ticks()
    assert 0 <= busy <= total and total > 0


# --- llama.cpp's cmake flags -----------------------------------------------------------------------------


def test_amd_avx2_flags_turn_on_avx2_and_below_and_everything_else_off():
    assert llamacpp.ggml_cpu_flags(x86(AMD_CPUINFO)) == AMD_FLAGS


def test_intel_xeon_flags_turn_on_avx512_vnni_bf16_and_keep_amx_and_native_off():
    flags = llamacpp.ggml_cpu_flags(x86(INTEL_CPUINFO))
    assert flags == INTEL_FLAGS_CMAKE
    assert all(flag(flags, option) == "OFF" for option in ("GGML_NATIVE", "GGML_AMX_TILE", "GGML_AMX_INT8",
                                                           "GGML_AMX_BF16"))


@pytest.mark.parametrize("missing", AVX512_SUBSETS)
def test_avx512_needs_all_five_subsets(missing):
    flags = llamacpp.ggml_cpu_flags(x86(without(INTEL_CPUINFO, missing)))
    assert flag(flags, "GGML_AVX512") == "OFF"
    # VNNI and BF16 compile with the AVX-512 flags too, so they go with it
    assert flag(flags, "GGML_AVX512_VNNI") == "OFF" and flag(flags, "GGML_AVX512_BF16") == "OFF"
    assert flag(flags, "GGML_AVX2") == "ON" and flag(flags, "GGML_AVX_VNNI") == "ON"


@pytest.mark.parametrize(("cpu_flag", "option"), [("avx512_vnni", "GGML_AVX512_VNNI"),
                                                  ("avx512_bf16", "GGML_AVX512_BF16"),
                                                  ("avx_vnni", "GGML_AVX_VNNI")])
def test_vnni_and_bf16_follow_their_own_flag(cpu_flag, option):
    full = llamacpp.ggml_cpu_flags(x86(INTEL_CPUINFO))
    less = llamacpp.ggml_cpu_flags(x86(without(INTEL_CPUINFO, cpu_flag)))
    assert flag(full, option) == "ON" and flag(less, option) == "OFF"
    assert [f for f in less if not f.startswith(f"-D{option}=")] == [
        f for f in full if not f.startswith(f"-D{option}=")]  # nothing else changes
    assert flag(less, "GGML_AVX512") == "ON"


def test_amx_stays_off_even_with_amx_fp16():
    flags = llamacpp.ggml_cpu_flags(x86(INTEL_CPUINFO.replace("amx_int8", "amx_int8 amx_fp16")))
    assert [f for f in flags if "AMX" in f] == AMX_OFF


def test_not_x86_leaves_it_to_ggml_native():
    arm = dataclasses.replace(parse_cpu("Features\t: fp asimd\n", 4, None), machine="aarch64")
    assert llamacpp.ggml_cpu_flags(arm) == ["-DGGML_NATIVE=ON"]


def test_default_cpu_is_this_one_read_without_torch(monkeypatch):
    asked = []

    def this_cpu(with_torch: bool = True) -> Cpu:
        asked.append(with_torch)
        return x86(AMD_CPUINFO)

    monkeypatch.setattr(llamacpp, "this_cpu", this_cpu)
    assert llamacpp.ggml_cpu_flags() == AMD_FLAGS
    assert asked == [False]


def test_llama_cpp_python_gets_the_same_flags_through_cmake_args(monkeypatch, tmp_path):
    monkeypatch.setenv("CORE_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(llamacpp, "this_cpu", lambda with_torch=True: x86(INTEL_CPUINFO))
    intel = llama_cpp_python.venv()
    assert intel.env == {"CMAKE_ARGS": " ".join(INTEL_FLAGS_CMAKE)}
    assert "--no-cache-dir" in intel.steps[0]  # the wheel cache would ignore CMAKE_ARGS
    monkeypatch.setattr(llamacpp, "this_cpu", lambda with_torch=True: x86(AMD_CPUINFO))
    amd = llama_cpp_python.venv()
    assert amd.env == {"CMAKE_ARGS": " ".join(AMD_FLAGS)}
    assert amd.digest() != intel.digest()  # another CPU's flags rebuild the virtualenv


# --- llama.cpp's build folder and the SIGILL check -------------------------------------------------------


def script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


SIGILL_BODY = "ulimit -c 0 2>/dev/null; kill -ILL $$"  # no core file


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """llamacpp.server_binary with the cache in tmp_path and a `cmake --build` that writes a script as
    llama-server (its body: `fake_build.body`); yields the state, with every command run."""

    class State:
        cpu = x86(AMD_CPUINFO)
        body = "exit 0"
        commands: list[list[str]] = []

    state = State()
    monkeypatch.setattr(llamacpp, "this_cpu", lambda with_torch=True: state.cpu)
    monkeypatch.setattr(llamacpp, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(llamacpp, "source_dir", lambda: tmp_path / "src")

    def run_logged(command, log_name, **kwargs):
        command = [str(part) for part in command]
        state.commands.append(command)
        if "--build" in command:
            script(Path(command[command.index("--build") + 1]) / "bin" / "llama-server", state.body)

    monkeypatch.setattr(llamacpp, "run_logged", run_logged)
    monkeypatch.chdir(tmp_path)
    return state


def test_build_folder_is_keyed_by_the_flags_and_reused(fake_build, tmp_path):
    amd = llamacpp.server_binary()
    configure = fake_build.commands[0]
    assert configure[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(amd.parent.parent)]
    assert configure[5:] == [*llamacpp.BUILD_FLAGS, *AMD_FLAGS]
    assert amd.parent.parent.parent == tmp_path / "llama-cpp" and amd.parent.parent.name.startswith("build-")
    assert (amd.parent.parent / ".core-bench-cmake-flags").read_text() == " ".join(configure[5:])

    fake_build.commands.clear()
    assert llamacpp.server_binary() == amd and fake_build.commands == []  # same flags: no rebuild

    fake_build.cpu = x86(INTEL_CPUINFO)
    intel = llamacpp.server_binary()
    fake_build.cpu = x86(without(INTEL_CPUINFO, "avx512_bf16"))  # one flag apart
    no_bf16 = llamacpp.server_binary()
    folders = {amd.parent.parent, intel.parent.parent, no_bf16.parent.parent}
    assert len(folders) == 3
    assert "-DGGML_AVX512_BF16=ON" in fake_build.commands[0] and "-DGGML_AVX512_BF16=OFF" in fake_build.commands[2]


def test_a_build_whose_binary_dies_is_a_setup_error_and_not_stamped(fake_build):
    fake_build.body = SIGILL_BODY
    with pytest.raises(SetupError, match="llama-server dies with SIGILL on this CPU"):
        llamacpp.server_binary()
    stamps = list(Path("llama-cpp").glob("build-*/.core-bench-cmake-flags"))
    assert stamps == []
    fake_build.commands.clear()
    with pytest.raises(SetupError, match="SIGILL"):  # the binary is there, but the next run checks again
        llamacpp.server_binary()
    assert fake_build.commands[0][0] == "cmake"


def test_a_stamp_with_other_flags_rebuilds(fake_build):
    binary = llamacpp.server_binary()
    (binary.parent.parent / ".core-bench-cmake-flags").write_text("-DGGML_NATIVE=ON")
    fake_build.commands.clear()
    assert llamacpp.server_binary() == binary
    assert [c[:2] for c in fake_build.commands] == [["cmake", "-S"], ["cmake", "--build"]]
    assert (binary.parent.parent / ".core-bench-cmake-flags").read_text() == " ".join(
        [*llamacpp.BUILD_FLAGS, *AMD_FLAGS])


def test_check_runs_raises_for_a_binary_killed_by_sigill(tmp_path):
    binary = script(tmp_path / "llama-server", SIGILL_BODY)
    flags = ["-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON"]
    with pytest.raises(SetupError) as caught:
        llamacpp.check_runs(binary, flags)
    message = str(caught.value)
    assert "llama-server dies with SIGILL on this CPU" in message
    assert "-DGGML_NATIVE=OFF -DGGML_AVX512=ON" in message  # says what it was built with


def test_check_runs_passes_a_binary_that_exits_0(tmp_path):
    binary = script(tmp_path / "llama-server", 'echo "version: 1 (abc)"; exit 0')
    assert llamacpp.check_runs(binary, ["-DGGML_NATIVE=OFF"]) is None


def test_check_runs_on_a_missing_binary_is_a_setup_error(tmp_path):
    with pytest.raises(SetupError, match="llama-server --version"):
        llamacpp.check_runs(tmp_path / "llama-server", [])


# --- core's rows -----------------------------------------------------------------------------------------


def test_gguf_kind_is_the_file_names_last_dotted_part():
    assert core_server.gguf_kind(GGUF) == "Q4_1 GGUF"
    assert core_server.gguf_kind(Path("model.gguf")) == "GGUF"


def test_label_for_no_flags_and_for_best_args():
    assert core_server.label(GGUF, []) == "core serve Q4_1 GGUF (no flags)"
    assert core_server.label(GGUF, ["--dtype", "bfloat16"]) == "core serve Q4_1 GGUF --dtype bfloat16"
    assert core_server.label(GGUF, ["--x", "a b"]) == "core serve Q4_1 GGUF --x 'a b'"


def test_launcher_adds_only_the_extra_args_the_address_and_the_model_name(monkeypatch):
    warmed = []
    monkeypatch.setattr(core_server, "warm_cache", lambda launch, url: warmed.append((launch, url)))
    ctx = Context(GGUF, convert=lambda: Path("unused"), port=8123, threads=3)
    plain = core_server.launcher()(ctx)
    # the row's own server is started once before the timed start, so that its caches are there
    assert warmed == [(plain, "http://127.0.0.1:8123/v1/models")]
    assert plain.command == [sys.executable, "-m", "core.cli", "serve", str(GGUF), "--host", "127.0.0.1",
                             "--port", "8123", "--served-model-name", "smollm2"]
    assert plain.env == {"OMP_NUM_THREADS": "3"} and plain.model == "smollm2"
    best = core_server.launcher(["--dtype", "bfloat16"])(ctx)
    assert warmed[-1][0] is best  # with its own flags: a dense row's caches are not a packed row's
    assert best.command[4:7] == [str(GGUF), "--dtype", "bfloat16"]
    assert best.command[7:] == plain.command[5:]


# --- the ISA ceiling (--isa-ceiling avx2) --------------------------------------------------------------

def test_an_avx2_ceiling_builds_llama_cpp_as_for_an_avx2_only_cpu():
    intel = dataclasses.replace(x86(INTEL_CPUINFO), ceiling="avx2")
    assert llamacpp.ggml_cpu_flags(intel) == AMD_FLAGS  # the AVX2-only EPYC's flags, option for option
    assert intel.isa == INTEL_ISA  # the CPU's own instruction sets are still what it reports
    line = intel.line()
    assert "**run limited to avx2** (sse4_2 avx avx2 fma f16c bmi2)" in line
    assert "CORE_CPU_KERNELS=avx2 and ATEN_CPU_CAPABILITY=avx2" in line and "vLLM not run" in line
    assert "limited" not in x86(INTEL_CPUINFO).line()


def test_the_ceiling_from_the_environment_holds_core_rows_and_refuses_vllm(monkeypatch):
    monkeypatch.setattr(core_server, "warm_cache", lambda launch, url: None)
    ctx = Context(GGUF, convert=lambda: Path("unused"), port=8123, threads=3)
    monkeypatch.setenv(cpu.CEILING_VARIABLE, "avx2")
    assert cpu.this_cpu(with_torch=False).ceiling == "avx2"
    assert core_server.launcher()(ctx).env == {"OMP_NUM_THREADS": "3", "CORE_CPU_KERNELS": "avx2",
                                               "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                               "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    with pytest.raises(SetupError, match="not run under the ISA ceiling avx2"):
        vllm.launch(ctx)
    monkeypatch.setenv(cpu.CEILING_VARIABLE, "sse9")
    with pytest.raises(ValueError, match="CORE_BENCH_ISA_CEILING must be one of avx2, got 'sse9'"):
        cpu.this_cpu(with_torch=False)
    monkeypatch.delenv(cpu.CEILING_VARIABLE)
    assert cpu.this_cpu(with_torch=False).ceiling is None


def test_an_isa_ceiling_tags_the_results_and_leaves_the_readme_alone():
    assert side_by_side.parse_args(["--isa-ceiling", "avx2"]).tag == "avx2-ceiling"
    assert side_by_side.parse_args(["--isa-ceiling", "avx2", "--tag", "b"]).tag == "b-avx2-ceiling"
    assert side_by_side.parse_args([]).tag == ""
    assert not side_by_side.parse_args(["--update-readme", "--isa-ceiling", "avx2"]).update_readme  # nox -s bench
    assert side_by_side.parse_args(["--update-readme"]).update_readme


def test_peers_has_a_core_best_row_only_with_best_args():
    plain = side_by_side.peers(GGUF, [])
    assert [p.key for p in plain] == ["core", "vllm", "llama-server", "llama-cpp-python", "transformers"]
    assert plain[0].label == "core serve Q4_1 GGUF (no flags)"
    best = side_by_side.peers(GGUF, ["--dtype", "bfloat16"])
    assert [p.key for p in best[:3]] == ["core", "core-best", "vllm"]
    assert best[1].label == "core serve Q4_1 GGUF --dtype bfloat16"


def test_core_best_args_are_split_like_a_shell():
    assert side_by_side.parse_args([]).core_best_args == shlex.split(side_by_side.CORE_BEST_ARGS)
    args = side_by_side.parse_args(["--core-best-args", "--dtype bfloat16 --quantization 'int4'"])
    assert args.core_best_args == ["--dtype", "bfloat16", "--quantization", "int4"]
    assert side_by_side.parse_args(["--core-best-args=--one-flag"]).core_best_args == ["--one-flag"]


@pytest.mark.parametrize(("busy", "noted"), [(0.5, True), (0.1, False), (None, False)])
def test_busy_cpus_are_noted(monkeypatch, busy, noted):
    monkeypatch.setattr(side_by_side, "busy_fraction", lambda: busy)
    row = Row("core", "core")
    side_by_side.note_busy_cpus(row)
    assert row.cpu_busy_before == busy
    note = "the CPUs were 50% busy with other work just before it started: its numbers may be low"
    assert row.notes == ([note] if noted else [])


# --- the report ------------------------------------------------------------------------------------------


def report_rows() -> list[Row]:
    return [Row("core", "core serve Q4_1 GGUF (no flags)", "1.0", decode_tok_s=50.0,
                throughput={1: 48.0, 8: 300.0}, peak_pss_mib=1000.0),
            Row("core-best", "core serve Q4_1 GGUF --dtype bfloat16", "1.0", decode_tok_s=200.0,
                throughput={1: 192.0, 8: 600.0}, peak_pss_mib=250.0),
            Row("llama-server", "llama.cpp", "b1", decode_tok_s=100.0, throughput={1: 96.0, 8: 150.0},
                peak_pss_mib=500.0, build_flags=AMD_FLAGS),
            Row("vllm", "vLLM", status="failed: exited with 1 while starting")]


def test_markdown_has_the_cpu_line_and_a_ratio_table_per_core_row():
    intel = x86(INTEL_CPUINFO, cores=8, torch_capability="AVX512")
    page = markdown(report_rows(), LEVELS, {"threads": 2}, "2025-01-02", "plot.png", intel)
    lines = page.splitlines()
    assert lines[2].startswith("Machine: Intel(R) Xeon(R) Platinum 8480+, 8 cores, ")
    assert lines[3] == intel.line() + "."
    heads = [i for i, line in enumerate(lines) if line.endswith("its ratio to each peer (core / peer; above 1: "
                                                                "core is faster, or for memory, uses more):")]
    assert [lines[i].split(":")[0] for i in heads] == ["core serve Q4_1 GGUF (no flags)",
                                                       "core serve Q4_1 GGUF --dtype bfloat16"]
    assert all(lines[i + 2].startswith("| core / peer |") for i in heads)
    plain_table, best_table = ("\n".join(lines[i + 2:i + 6]) for i in heads)
    assert "| llama.cpp | 0.50x | 0.50x | 2.00x | 2.00x |" in plain_table
    assert "| llama.cpp | 2.00x | 2.00x | 4.00x | 0.50x |" in best_table
    for table in (plain_table, best_table):
        assert "| vLLM | - | - | - | - |" in table
        assert "core serve" not in table  # a core row is not its own peer


def test_no_ratio_table_without_peers_or_without_core_rows():
    rows = report_rows()
    assert ratio_tables(rows[:2], LEVELS) == []
    assert ratio_tables(rows[2:], LEVELS) == []
    assert len([part for part in ratio_tables(rows[:1] + rows[2:], LEVELS) if part.startswith("| core / peer")]) == 1


def test_json_has_the_cpu_object_and_the_rows_build_flags(tmp_path):
    amd = x86(AMD_CPUINFO, torch_capability="AVX2")
    path = tmp_path / "out.json"
    write_json(report_rows(), {"threads": 2}, path, amd)
    data = json.loads(path.read_text())
    assert data["cpu"] == {"model": "AMD EPYC 7763 64-Core Processor", "vendor": "AuthenticAMD", "cores": 2,
                           "isa": list(AVX2_ONLY_ISA), "torch_capability": "AVX2", "machine": "x86_64",
                           "ceiling": None}
    assert data["machine"].startswith("AMD EPYC 7763 64-Core Processor, 2 cores, ")
    assert data["rows"][2]["build_flags"] == AMD_FLAGS and data["rows"][0]["build_flags"] == []


def test_gguf_kind_reads_the_quantization_that_ends_the_file_name():
    from peers.core_server import gguf_kind

    assert gguf_kind(Path("SmolLM2-1.7B-Instruct-Q4_K_M.gguf")) == "Q4_K_M GGUF"
    assert gguf_kind(Path("qwen2-iq4_xs.gguf")) == "IQ4_XS GGUF"
    assert gguf_kind(Path("model.gguf")) == "GGUF"
