"""The `data` image's tools, each run in a real sandbox on that image and judged by what it made.

One sandbox serves the whole module (one start; each test uses its own files in it). Inputs are
made on the test side and written into /workspace; outputs are read back and parsed here (PNG
header, PDF text and fonts, DOCX paragraphs, ffprobe's JSON), so a tool that exits 0 without
doing its job fails its test.
"""

from __future__ import annotations

import csv
import io
import json
import re
import shlex
import struct
from collections.abc import AsyncIterator
from typing import Any

import docx
import pypdf
import pytest
import pytest_asyncio

from agentbox.machines.base import ExecRequest
from agentbox.machines.cgroups import Limits
from agentbox.machines.sandbox import SandboxConfig, SandboxMachine
from tests.conftest import built_image, image_sandbox_host, sandbox_factory, traversable

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: Memory of the module's sandbox (Limits' default, named because LibreOffice needs most of it).
DATA_MEMORY_BYTES = 2 * 1024**3
#: Seconds one tool's command may take. LibreOffice's first start in an empty $HOME is the
#: slowest (about 2 s on an idle machine; a loaded 2-core one stretches it to tens of seconds).
TOOL_TIMEOUT = 100.0
#: Bytes every PNG starts with.
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: The CJK family xelatex and the OCR images are set in (fonts-noto-cjk).
CJK_FAMILY = "Noto Sans CJK SC"
#: How that family's PDF font names start: every face of the .ttc shares one CFF table, named
#: for the first (Japanese) face, so an SC face embeds as "NotoSansCJKjp-Regular".
CJK_FONT_NAME = "NotoSansCJK"
#: Pixel size of the text rendered for OCR. Tesseract's models are trained on text about this
#: size; at 64 px and above chi_sim reads 数 as 效.
OCR_FONT_PX = 48


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def box(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SandboxMachine]:
    """One started sandbox on the `data` image, network off, stopped after the module."""
    host = image_sandbox_host(built_image("data", "data"), tmp_path_factory)
    make, made = sandbox_factory(host, traversable(tmp_path_factory.mktemp("data-box"), tmp_path_factory))
    config = SandboxConfig(
        network=False, image="data", image_required=True, limits=Limits(memory_bytes=DATA_MEMORY_BYTES)
    )
    try:
        m = await make(config)
        assert m.capabilities()["image"] == "data"
        yield m
    finally:
        for started in made:
            await started.stop()


async def run(m: SandboxMachine, command: str) -> str:
    """`command`'s stdout; the test fails with its stderr when it exits non-zero."""
    r = await m.exec(ExecRequest(command=command, timeout=TOOL_TIMEOUT))
    out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    assert r.exit_code == 0 and not r.timed_out, f"{command!r} exited {r.exit_code}:\n{out}\n{err}"
    return out


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, which must come first."""
    assert data[:8] == PNG_SIGNATURE, f"not a PNG: {data[:8]!r}"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13, f"first chunk is {kind!r} of {length} bytes"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def pdf_text(data: bytes) -> str:
    return "\n".join(page.extract_text() for page in pypdf.PdfReader(io.BytesIO(data)).pages)


def squeeze(text: str) -> str:
    """`text` without any whitespace: PDF and OCR text breaks and spaces words as it likes."""
    return re.sub(r"\s+", "", text)


async def test_pandas_aggregates_a_csv(box: SandboxMachine) -> None:
    rows = [(city, (i * 37) % 101 + 0.25 * i) for i, city in enumerate(["Oslo", "Lima", "Pune"] * 7)]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["city", "sales"])
    writer.writerows(rows)
    await box.write("/workspace/sales.csv", buf.getvalue().encode())
    expected: dict[str, float] = {}
    for city, sales in rows:
        expected[city] = expected.get(city, 0.0) + sales

    out = await run(
        box,
        "python3 -c \"import pandas as pd; d = pd.read_csv('sales.csv');"
        " print(d.groupby('city')['sales'].sum().to_json())\"",
    )

    got = json.loads(out)
    assert got.keys() == expected.keys()
    for city, total in expected.items():
        assert got[city] == pytest.approx(total)


async def test_pandas_round_trips_an_excel_file(box: SandboxMachine) -> None:
    out = await run(
        box,
        "python3 -c \"import pandas as pd; pd.DataFrame({'n': [3, 4], 'w': ['数', 'x']}).to_excel('t.xlsx', index=False);"
        " d = pd.read_excel('t.xlsx'); print(d.to_json(orient='records', force_ascii=False))\"",
    )
    assert json.loads(out) == [{"n": 3, "w": "数"}, {"n": 4, "w": "x"}]
    assert (await box.read("/workspace/t.xlsx"))[:2] == b"PK"  # a real OOXML zip


async def test_matplotlib_writes_a_png_of_the_asked_size(box: SandboxMachine) -> None:
    width, height, dpi = 321, 123, 50
    script = (
        "import matplotlib\n"
        "matplotlib.use('Agg')\n"
        "import matplotlib.pyplot as plt\n"
        f"fig = plt.figure(figsize=({width}/{dpi}, {height}/{dpi}), dpi={dpi})\n"
        "plt.plot([0, 1, 2], [2, 0, 1])\n"
        "fig.savefig('plot.png')\n"
    )
    await box.write("/workspace/plot.py", script.encode())

    await run(box, "python3 plot.py")

    assert png_size(await box.read("/workspace/plot.png")) == (width, height)


async def test_libreoffice_converts_docx_to_pdf(box: SandboxMachine) -> None:
    sentence = "The quarterly ledger balances at 4711 crowns."
    document = docx.Document()
    document.add_heading("Ledger", level=1)
    document.add_paragraph(sentence)
    buf = io.BytesIO()
    document.save(buf)
    await box.write("/workspace/ledger.docx", buf.getvalue())

    await run(box, "soffice --headless --convert-to pdf --outdir /workspace /workspace/ledger.docx")

    assert squeeze(sentence) in squeeze(pdf_text(await box.read("/workspace/ledger.pdf")))


async def test_pandoc_converts_markdown_to_docx(box: SandboxMachine) -> None:
    heading, paragraph = "Findings of the survey", "Seventeen of twenty wells ran dry by August."
    await box.write("/workspace/report.md", f"# {heading}\n\n{paragraph}\n".encode())

    await run(box, "pandoc report.md -o report.docx")

    paragraphs = docx.Document(io.BytesIO(await box.read("/workspace/report.docx"))).paragraphs
    headings = [p.text for p in paragraphs if p.style is not None and p.style.name == "Heading 1"]
    assert headings == [heading]
    assert paragraph in [p.text for p in paragraphs]


async def test_xelatex_sets_chinese_in_noto_cjk(box: SandboxMachine) -> None:
    chinese = "数据分析与文档处理"
    families = await run(box, "fc-list :lang=zh family")
    assert CJK_FAMILY in families, families
    tex = (
        "\\documentclass{article}\n"
        "\\usepackage{xeCJK}\n"
        f"\\setCJKmainfont{{{CJK_FAMILY}}}\n"
        "\\begin{document}\n"
        f"Report: {chinese}\n"
        "\\end{document}\n"
    )
    await box.write("/workspace/zh.tex", tex.encode())

    await run(box, "xelatex -interaction=nonstopmode -halt-on-error zh.tex")

    reader = pypdf.PdfReader(io.BytesIO(await box.read("/workspace/zh.pdf")))
    assert len(reader.pages) == 1
    assert chinese in squeeze(reader.pages[0].extract_text())
    fonts = [str(f["/BaseFont"]) for f in reader.pages[0]["/Resources"]["/Font"].values()]
    assert any(CJK_FONT_NAME in f for f in fonts), fonts


async def probe(m: SandboxMachine, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """ffprobe's (only stream, format) of the video `name`, frames counted by decoding them."""
    out = await run(m, f"ffprobe -v error -count_frames -show_streams -show_format -of json {name}")
    found = json.loads(out)
    (stream,) = found["streams"]
    return stream, found["format"]


async def test_ffmpeg_transcodes_and_ffprobe_reads_the_result(box: SandboxMachine) -> None:
    seconds, rate = 1, 10
    await run(
        box,
        f"ffmpeg -loglevel error -y -f lavfi -i testsrc=duration={seconds}:size=160x120:rate={rate}"
        " -c:v libx264 -pix_fmt yuv420p clip.mp4"
        " && ffmpeg -loglevel error -y -i clip.mp4 -vf scale=80:60"
        " -c:v libvpx-vp9 -deadline realtime -cpu-used 8 clip.webm",
    )

    for name, codec, size, container in (
        ("clip.mp4", "h264", (160, 120), "mp4"),
        ("clip.webm", "vp9", (80, 60), "webm"),
    ):
        stream, container_info = await probe(box, name)
        assert (stream["codec_name"], (stream["width"], stream["height"])) == (codec, size), name
        assert int(stream["nb_read_frames"]) == seconds * rate, name
        assert float(container_info["duration"]) == pytest.approx(seconds, abs=1 / rate), name
        assert container in container_info["format_name"].split(","), name


#: Draws argv's one line of text on white, in a face given by file and index: run in the sandbox,
#: so the image is made of the image's own PIL (matplotlib's dependency) and fonts.
RENDER_LINE = """import sys
from PIL import Image, ImageDraw, ImageFont
out, file, index, px, text = sys.argv[1:]
size = int(px)
font = ImageFont.truetype(file, size, index=int(index))
image = Image.new("L", (size * (len(text) + 2), 3 * size), 255)
ImageDraw.Draw(image).text((size, size), text, font=font, fill=0)
image.save(out)
"""
#: (Tesseract language, the family its line is set in, the line).
OCR_LINES = (
    ("eng", CJK_FAMILY, "Quick brown foxes jump 2024"),
    ("chi_sim", CJK_FAMILY, "数据分析与文档处理"),
    ("chi_tra", "Noto Sans CJK TC", "數據分析與文檔處理"),
)


@pytest.mark.parametrize(("lang", "family", "line"), OCR_LINES)
async def test_tesseract_reads_back_a_rendered_line(
    box: SandboxMachine, lang: str, family: str, line: str
) -> None:
    face = (await run(box, f"fc-match '{family}' --format '%{{file}}\n%{{index}}'")).splitlines()
    await box.write("/workspace/render_line.py", RENDER_LINE.encode())
    await run(box, f"python3 render_line.py {lang}.png {shlex.join(face)} {OCR_FONT_PX} {shlex.quote(line)}")

    # --psm 7: the image is one line of text.
    read = " ".join((await run(box, f"tesseract {lang}.png - -l {lang} --psm 7 2>/dev/null")).split())

    # Chinese puts no spaces between words; Tesseract puts some between characters.
    assert (read if lang == "eng" else squeeze(read)) == line


async def test_node_runs_a_script_that_prints_json(box: SandboxMachine) -> None:
    limit = 1000
    script = (
        "const limit = Number(process.argv[2]);\n"
        "const primes = [];\n"
        "for (let n = 2; n < limit; n++) if (primes.every((p) => n % p !== 0)) primes.push(n);\n"
        "console.log(JSON.stringify({count: primes.length, sum: primes.reduce((a, b) => a + b, 0),"
        " node: process.version}));\n"
    )
    await box.write("/workspace/primes.js", script.encode())

    got = json.loads(await run(box, f"node primes.js {limit}"))

    primes = [n for n in range(2, limit) if all(n % p for p in range(2, int(n**0.5) + 1))]
    assert (got["count"], got["sum"]) == (len(primes), sum(primes))
    assert re.fullmatch(r"v\d+\.\d+\.\d+", got["node"])
