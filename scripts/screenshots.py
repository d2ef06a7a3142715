"""Screenshots of a report's leaderboard and of a FAIL's item view (headless Chromium), for the README and docs.

    python3 scripts/screenshots.py results/quickstart/report/leaderboard.html --out docs/img

Writes ``leaderboard.png`` (the page as it opens) and ``fail-items.png`` (the first FAIL's item view, followed from
its leaderboard cell as a reader would). Needs ``chromium``, ``chromium-driver`` and ``selenium``
(``bash scripts/setup.sh --test``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def browser(width: int, height: int):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    binary = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    driver = shutil.which("chromedriver")
    if not binary or not driver:
        sys.exit("screenshots.py: needs Chromium and chromedriver (bash scripts/setup.sh --test)")
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
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    driver = browser(args.width, args.height)
    try:
        driver.get(args.page.resolve().as_uri())
        driver.save_screenshot(str(args.out / "leaderboard.png"))
        fail = driver.find_elements("css selector", "#leaderboard td.FAIL a")
        if not fail:
            sys.exit(f"screenshots.py: {args.page} has no FAIL to follow")
        fail[0].click()
        driver.execute_script("document.querySelector('section.items article.item').scrollIntoView()")
        driver.save_screenshot(str(args.out / "fail-items.png"))
    finally:
        driver.quit()
    print(f"wrote {args.out / 'leaderboard.png'} and {args.out / 'fail-items.png'}")


if __name__ == "__main__":
    main()
