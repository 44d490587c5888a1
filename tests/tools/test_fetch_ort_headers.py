"""tools/fetch_ort_headers.sh takes the Debian archive from the machine's apt sources (one-line and
deb822 formats; the security archive is not it), keeps the environment override, and says to set
it when apt names no Debian archive."""
import os
import subprocess

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "tools", "fetch_ort_headers.sh")


def mirror(etc, **env):
    e = {k: v for k, v in os.environ.items() if k != "ONNX_LIGHT_ORT_DEB_MIRROR"}
    e.update(ONNX_LIGHT_APT_ETC=str(etc), **env)
    return subprocess.run(["bash", SCRIPT, "--print-mirror"], capture_output=True, text=True, env=e,
                          check=True).stdout.strip()


def test_one_line_sources(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text("# comment\ndeb [arch=amd64 signed-by=/k.gpg] "
                                           "http://mirror.example/debian/ bookworm main\n")
    assert mirror(tmp_path) == "http://mirror.example/debian"


def test_deb822_sources_skip_security(tmp_path):
    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "debian.sources").write_text("Types: deb\nURIs: http://proxy.example:3142/debian-security\n"
                                      "Suites: bookworm-security\n\nTypes: deb\n"
                                      "URIs: http://proxy.example:3142/debian\nSuites: bookworm\n")
    assert mirror(tmp_path) == "http://proxy.example:3142/debian"


def test_no_debian_archive_is_an_error_naming_the_override(tmp_path):
    (tmp_path / "sources.list").write_text("deb http://archive.ubuntu.com/ubuntu noble main\n")
    e = {k: v for k, v in os.environ.items() if k != "ONNX_LIGHT_ORT_DEB_MIRROR"}
    e["ONNX_LIGHT_APT_ETC"] = str(tmp_path)
    r = subprocess.run(["bash", SCRIPT, "--print-mirror"], capture_output=True, text=True, env=e)
    assert r.returncode != 0 and "set ONNX_LIGHT_ORT_DEB_MIRROR" in r.stderr and "ONNXRUNTIME_INCLUDE_DIR" in r.stderr
    assert mirror(tmp_path, ONNX_LIGHT_ORT_DEB_MIRROR="http://own.example/debian") == "http://own.example/debian"
