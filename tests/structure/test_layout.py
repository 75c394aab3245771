"""Small files: no module of the package or its plugins is over 500 lines (issue 21's bar; torchao's optim
package, the model STYLE.md names, has a median of about 250)."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_LINES = 500


def test_no_module_over_500_lines():
    sizes = {path.relative_to(ROOT): len(path.read_text().splitlines())
             for folder in ("xirang_ds", "plugins") for path in (ROOT / folder).rglob("*.py")}
    assert len(sizes) > 50  # the scan found the package
    over = {str(p): n for p, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by concept): {over}"
