"""scripts/client.py: its command line (it talks to a real server in tests/test_serving.py)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_describes_it_in_whole_sentences():
    r = subprocess.run([sys.executable, "scripts/client.py", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-500:]
    assert "prints the text as it arrives, then the finish reason." in " ".join(r.stdout.split())
