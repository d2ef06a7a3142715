"""Screenshots of a report's leaderboard and of a FAIL's item view (headless Chromium), for the README and docs.

    python3 scripts/screenshots.py results/quickstart/report/leaderboard.html --out docs/img

Writes ``<prefix>leaderboard.png`` (the page as it opens) and ``<prefix>items.png``: the first FAIL's item view,
followed from its leaderboard cell as a reader would (or, on a page with no FAIL, the first cell that links to
changed items). ``--prefix lm-eval-`` names the shots of an lm-eval report apart. Needs ``chromium``, ``chromium-driver`` and ``selenium``
(``bash scripts/setup.sh --test``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def refuse(message: str) -> None:
    """Bad input or a missing browser: one line and exit code 2, as kveval's own commands (1 is a gate's FAIL)."""
    print(f"screenshots.py: {message}", file=sys.stderr)
    sys.exit(2)


def browser(width: int, height: int):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    binary = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    driver = shutil.which("chromedriver")
    if not binary or not driver:
        refuse("needs Chromium and chromedriver (bash scripts/setup.sh --test)")
    options = Options()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("page", type=Path, help="a report's leaderboard.html")
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1000)
    parser.add_argument("--prefix", default="", help="file name prefix, e.g. lm-eval-")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    driver = browser(args.width, args.height)
    try:
        driver.get(args.page.resolve().as_uri())
        board, items = args.out / f"{args.prefix}leaderboard.png", args.out / f"{args.prefix}items.png"
        driver.save_screenshot(str(board))
        links = (driver.find_elements("css selector", "#leaderboard td.FAIL a")
                 or driver.find_elements("css selector", "#leaderboard td a"))
        if not links:
            refuse(f"{args.page} links to no changed items")
        links[0].click()
        driver.execute_script("document.querySelector('section.items article.item').scrollIntoView()")
        driver.save_screenshot(str(items))
    finally:
        driver.quit()
    print(f"wrote {board} and {items}")


if __name__ == "__main__":
    main()
