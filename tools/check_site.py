"""Check the built site in a real browser, with the network off.

    python tools/check_site.py _build/html [--width 1280] [--only PATTERN]

Serves the site on 127.0.0.1, opens every page in headless Chromium (the
system's ``chromium``, driven by Playwright) with every request to another
host refused, and fails when a page

* has math that MathJax did not render (or rendered as a TeX error),
* has a broken image, or a link to a page or anchor of the site that does not
  exist,
* has a widget whose saved state did not render,
* has code, an output, a table, display math or an image wider than the
  content column that is cut off or runs past it instead of scrolling inside
  it (the element's content width, ``scrollWidth``, against the column),
* asks for anything from the network (a CDN script, a font), or throws.

Links to other sites are counted but not followed (the network is off).
Prints a summary and every problem as ``page: kind: detail``; exit status 1
when there is any. ``make check-site`` installs Chromium and Playwright when
missing, runs ``make book`` when a source of the book is newer than the last
checked build, and runs this on ``_build/html``.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import html.parser
import re
import shutil
import sys
import threading
from collections import Counter
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlsplit

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

# Runs in the page once MathJax and the widgets are done. Returns what the
# page holds and what is wrong with it.
MEASURE = r"""
() => {
  const problems = [];
  const say = (kind, el, extra) => {
    const text = (el.textContent || el.getAttribute('src') || '')
      .replace(/\s+/g, ' ').trim().slice(0, 70);
    problems.push([kind, `${extra} <${el.tagName.toLowerCase()}> ${text}`]);
  };
  document.querySelectorAll('details').forEach(d => { d.open = true; });

  // math
  const maths = [...document.querySelectorAll('.math')];
  for (const el of maths) {
    if (!el.querySelector('mjx-container')) say('unrendered math', el, '');
    else if (el.querySelector('mjx-merror')) say('math error', el, '');
  }

  // images
  const imgs = [...document.querySelectorAll('img')];
  for (const el of imgs) {
    if (!el.complete || el.naturalWidth === 0) say('broken image', el, '');
  }

  // widgets: each saved view must have been replaced by a rendered widget
  const views = [...document.querySelectorAll(
    'script[type="application/vnd.jupyter.widget-view+json"]')];
  for (const el of views) {
    const host = el.parentElement;
    if (!host.querySelector('.jupyter-widgets, .widget-subarea, .lm-Widget'))
      say('widget not rendered', host, '');
  }

  // width: content must fit the column or scroll inside it
  const column = document.querySelector('article.bd-article')
    || document.querySelector('main') || document.body;
  const colRight = column.getBoundingClientRect().right;
  const scrolls = s => s === 'auto' || s === 'scroll';
  const clips = s => s === 'hidden' || s === 'clip';
  const wide = [...column.querySelectorAll(
    'pre, table, img, mjx-container[display="true"], div.math, '
    + 'div.cell_output .output, figure')];
  let measured = 0, scrolling = 0;
  for (const el of wide) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.height === 0) continue;  // not displayed
    measured += 1;
    const contentRight = r.left + Math.max(el.scrollWidth, r.width);
    let node = el, verdict = null;
    while (node && node !== column && node !== document.body) {
      const nr = node.getBoundingClientRect();
      const ox = getComputedStyle(node).overflowX;
      if (scrolls(ox)) {
        if (nr.right > colRight + 1) verdict = 'runs past the column';
        else verdict = 'ok';
        break;
      }
      if (clips(ox) && contentRight > nr.right + 1) {
        verdict = 'cut off'; break;
      }
      node = node.parentElement;
    }
    if (verdict === null)
      verdict = contentRight > colRight + 1 ? 'runs past the column' : 'ok';
    if (verdict === 'ok' && contentRight > r.right + 1) scrolling += 1;
    if (verdict !== 'ok') {
      const px = Math.round(contentRight - colRight);
      say(`too wide (${verdict})`, el, `${px} px over the column:`);
    }
  }
  if (document.documentElement.scrollWidth > window.innerWidth + 1)
    problems.push(['page scrolls sideways',
      `${document.documentElement.scrollWidth} px > ${window.innerWidth}`]);

  return {
    problems,
    ids: [...document.querySelectorAll('[id]')].map(e => e.id),
    names: [...document.querySelectorAll('a[name]')].map(e => e.name),
    links: [...document.querySelectorAll('a[href]')].map(a => a.href),
    counts: {math: maths.length, images: imgs.length, widgets: views.length,
             measured, scrolling},
  };
}
"""

# Resolves once MathJax has typeset the page (immediately without MathJax).
MATH_DONE = """
() => (window.MathJax && MathJax.startup && MathJax.startup.promise)
  ? MathJax.startup.promise.then(() => true) : true
"""

WIDGETS_DONE = """
() => [...document.querySelectorAll(
  'script[type="application/vnd.jupyter.widget-view+json"]')].every(
  s => s.parentElement.querySelector(
    '.jupyter-widgets, .widget-subarea, .lm-Widget'))
"""


def settle_and_measure(page) -> dict:
    """Wait for MathJax and the widgets, then measure; a page that
    navigates on load (a redirect) is measured where it lands."""
    for attempt in range(3):
        try:
            page.evaluate(MATH_DONE)
            try:
                page.wait_for_function(WIDGETS_DONE, timeout=15_000)
            except PlaywrightTimeout:  # reported as 'widget not rendered'
                pass
            return page.evaluate(MEASURE)
        except PlaywrightError as err:
            if "context was destroyed" not in str(err) or attempt == 2:
                raise
            page.wait_for_load_state("load")
    raise AssertionError("unreachable")


REDIRECT = re.compile(
    r'<meta http-equiv="refresh" content="\d+; url=([^"]+)"', re.IGNORECASE)

# Script errors of the toolchain, not of the book. sphinx-thebe 0.3.1 (loaded
# by Jupyter Book even when, as here, the live-code launcher is off) declares
# its settings twice on every page; only that launcher would need them.
KNOWN_ERRORS = ("Identifier 'THEBE_JS_URL' has already been declared",)


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the report readable
        pass


def serve(root: Path) -> tuple[ThreadingHTTPServer, str]:
    handler = functools.partial(_Quiet, directory=str(root))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def pages(root: Path, only: str | None) -> list[Path]:
    skip = ("_static", "_sources", "_images", "_downloads", "vendor")
    out = []
    for p in sorted(root.rglob("*.html")):
        rel = p.relative_to(root)
        if rel.parts[0] in skip:
            continue
        if only and not fnmatch.fnmatch(str(rel), only):
            continue
        out.append(p)
    return out


class _Ids(html.parser.HTMLParser):
    """The anchors of a page that the browser did not open."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k == "id" or (tag == "a" and k == "name"):
                self.ids.add(v)


def anchors_of(path: Path, seen: dict[Path, set[str]]) -> set[str]:
    if path not in seen:
        parser = _Ids()
        parser.feed(path.read_text(errors="replace"))
        seen[path] = parser.ids
    return seen[path]


def check_links(root, base, links_by_page, ids_by_page):
    """Problems with the site's own links; counts of internal and external."""
    problems, internal, external = [], 0, set()
    for page, links in links_by_page.items():
        for link in links:
            url, frag = urldefrag(link)
            if not url.startswith(base):
                if urlsplit(url).scheme in ("http", "https"):
                    external.add(url)
                continue
            internal += 1
            path = root / unquote(urlsplit(url).path).lstrip("/")
            if path.is_dir():
                path = path / "index.html"
            if not path.exists():
                problems.append((page, "broken link", link[len(base):]))
            elif frag and path.suffix == ".html":
                if unquote(frag) not in anchors_of(path, ids_by_page):
                    problems.append(
                        (page, "broken anchor", link[len(base):]))
    return problems, internal, len(external)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("site", type=Path, help="the built site (_build/html)")
    ap.add_argument("--width", type=int, default=1280,
                    help="browser window width in CSS pixels")
    ap.add_argument("--only", help="check only pages matching this glob")
    ap.add_argument("--chromium", default=shutil.which("chromium")
                    or shutil.which("chromium-browser"),
                    help="the Chromium executable")
    args = ap.parse_args(argv)
    root = args.site.resolve()
    if not (root / "index.html").exists():
        ap.error(f"site: no index.html in {root}; build the book first")
    if not args.chromium:
        ap.error("chromium: not found; `apt-get install chromium`")

    server, base = serve(root)
    problems: list[tuple[str, str, str]] = []
    counts: Counter = Counter()
    refused: set[str] = set()
    links_by_page, ids_by_page = {}, {}
    todo = pages(root, args.only)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=args.chromium,
            args=["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"])
        context = browser.new_context(
            viewport={"width": args.width, "height": 900},
            service_workers="block")

        def network_off(route):
            refused.add(route.request.url)
            try:
                route.abort("internetdisconnected")
            except PlaywrightError:  # its page was closed meanwhile
                pass

        context.route(lambda url: not url.startswith(base), network_off)
        for path in todo:
            rel = str(path.relative_to(root))
            target = REDIRECT.search(path.read_text(errors="replace"))
            if target:  # a redirect page: its target is checked as a link
                links_by_page[rel] = [urljoin(f"{base}/{rel}",
                                              target.group(1))]
                continue
            page = context.new_page()
            asked: list[str] = []
            errors: list[str] = []
            page.on("request", lambda r, a=asked: a.append(r.url))
            page.on("pageerror", lambda e, er=errors: er.append(str(e)))
            page.goto(f"{base}/{rel}", wait_until="load")
            result = settle_and_measure(page)
            page.close()
            for kind, detail in result["problems"]:
                problems.append((rel, kind, detail))
            for url in asked:
                if not url.startswith(base) and not url.startswith("data:"):
                    problems.append((rel, "needs the network", url))
            for err in errors:
                if not any(known in err for known in KNOWN_ERRORS):
                    problems.append((rel, "script error",
                                     err.splitlines()[0]))
            counts.update(result["counts"])
            counts["pages"] += 1
            links_by_page[rel] = result["links"]
            ids_by_page[path] = set(result["ids"]) | set(result["names"])
        browser.close()
    server.shutdown()

    link_problems, internal, external = check_links(
        root, base, links_by_page, ids_by_page)
    problems += link_problems
    kinds = Counter(kind for _, kind, _ in problems)
    print(
        f"check-site: {counts['pages']} pages at {args.width} px, network "
        f"off: {counts['math']} math elements, {counts['images']} images, "
        f"{counts['widgets']} widgets, {counts['measured']} wide-element "
        f"candidates measured ({counts['scrolling']} scroll inside the "
        f"column), {internal} internal links checked, "
        f"{external} external links not followed")
    if not problems:
        print("check-site: no problems")
        return 0
    for page, kind, detail in problems:
        print(f"{page}: {kind}: {detail}")
    summary = ", ".join(f"{n} {k}" for k, n in kinds.most_common())
    print(f"check-site: {len(problems)} problems ({summary})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
