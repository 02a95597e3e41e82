//! `kernelforge report` in a real browser: every page of the fixture site loads in headless
//! Chromium with its style sheet and images and without a console message. Skipped, saying so,
//! where no `chromium` binary exists.

mod report_support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kernelforge::report::render_site;
use report_support::*;

/// A Chromium (or Chrome) binary: `$KERNELFORGE_CHROMIUM`, else the first of the usual names on
/// the PATH.
fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KERNELFORGE_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
        .find(|p| p.is_file())
}

/// Loads `page` in headless Chromium; returns the console messages and load errors it logged,
/// and the serialized DOM of the page after the load (or why the browser could not run).
fn load_in_chromium(bin: &Path, page: &Path, profile: &Path) -> Result<(Vec<String>, String), String> {
    use std::process::{Command, Stdio};
    let mut child = Command::new(bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--allow-file-access-from-files",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=30000",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("file://{}", page.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    // Drain both pipes while waiting (a large DOM would fill the pipe and stall the browser).
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut p) = pipe {
                let _ = std::io::Read::read_to_string(&mut p, &mut text);
            }
            text
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().map_err(|e| e.to_string())?.is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{}: no answer in 120 s", page.display()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (dom, stderr) = (stdout.join().unwrap_or_default(), stderr.join().unwrap_or_default());
    let problems = stderr
        .lines()
        .filter(|l| {
            l.contains(":CONSOLE")
                || l.contains("Uncaught")
                || l.contains("Failed to load resource")
                || l.contains("ERR_FILE_NOT_FOUND")
                || l.contains("Not allowed to load local resource")
        })
        .map(String::from)
        .collect();
    Ok((problems, dom))
}

/// A page outside the site that loads every page of it in a frame and, once each has loaded,
/// writes one line per page: `ok`, or what is wrong (no footer: cut short; no style rules:
/// the style sheet did not load; an image that did not decode).
fn harness(pages: &[String]) -> String {
    let list: Vec<String> = pages.iter().map(|p| format!("{p:?}")).collect();
    format!(
        r#"<!doctype html><meta charset="utf-8"><title>check</title><pre id="out">pending</pre><script>
const pages = [{}];
const results = [];
let left = pages.length;
for (const p of pages) {{
  const f = document.createElement("iframe");
  f.width = 1400; f.height = 900;
  f.onload = () => {{
    let msg = "ok";
    try {{
      const d = f.contentDocument;
      if (!d || !d.querySelector("footer")) msg = "incomplete";
      else if (d.styleSheets.length < 1 || d.styleSheets[0].cssRules.length < 10) msg = "no style sheet";
      else for (const img of d.images) if (!img.complete || img.naturalWidth === 0) msg = "broken image " + img.getAttribute("src");
    }} catch (e) {{ msg = "error " + e; }}
    results.push(p + ": " + msg);
    if (--left === 0) document.getElementById("out").textContent = results.sort().join("\n");
  }};
  f.src = p;
  document.body.appendChild(f);
}}
</script>"#,
        list.join(",")
    )
}

/// In a real browser: every page of the fixture site loads whole (style sheet applied, every
/// image decoded) with no console message and no failed load. One Chromium run loads them all
/// in frames of a check page kept outside the site. Skipped, saying so, where no Chromium is
/// installed; `apt-get install chromium` (Debian) enables it.
#[test]
fn every_page_loads_in_chromium_without_console_errors() {
    let Some(bin) = chromium() else {
        println!("SKIPPED every_page_loads_in_chromium_without_console_errors: no chromium binary on the PATH (install Debian's `chromium` or set KERNELFORGE_CHROMIUM)");
        eprintln!("SKIPPED: no chromium binary on the PATH; the browser check did not run");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("site");
    render_site(&fixture_input(), &out).unwrap();
    let pages: Vec<String> = files(&out)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|x| x == "html"))
        .map(|p| format!("site/{}", p.display()))
        .collect();
    let check = tmp.path().join("check.html");
    std::fs::write(&check, harness(&pages)).unwrap();
    let (problems, dom) = load_in_chromium(&bin, &check, &tmp.path().join("profile")).unwrap();
    assert!(
        problems.is_empty(),
        "console messages or failed loads:\n{}",
        problems.join("\n")
    );
    let start = dom.find("<pre id=\"out\">").expect("the check page ran") + 15;
    let report = &dom[start..start + dom[start..].find("</pre>").unwrap()];
    let lines: Vec<&str> = report.lines().collect();
    assert_eq!(lines.len(), pages.len(), "every page reported:\n{report}");
    let bad: Vec<&&str> = lines.iter().filter(|l| !l.ends_with(": ok")).collect();
    assert!(bad.is_empty(), "{bad:#?}");
    println!("chromium ({}) loaded {} pages, all whole", bin.display(), pages.len());
}
