//! `reckon lab eviction` at a small size, then `reckon lab report --html` over it and a kv-quant leg: the
//! page holds every leg's command, table and plots, and needs nothing outside itself. Headless Chromium
//! (Debian's `chromium`, which scripts/setup-clients installs) then loads the page: its own check finds
//! every plot drawn with a size, and the screenshot is not blank. Skipped (with a note) when SmolLM2 is
//! not fetched, unless RECKON_REQUIRE_MODELS=1; the browser half is skipped without Chromium, unless
//! RECKON_REQUIRE_BROWSER=1 (CI).

mod common;

use std::path::Path;
use std::process::Command;

fn reckon(args: &[&str], out: &Path) -> String {
    let run = Command::new(env!("CARGO_BIN_EXE_reckon")).args(args).arg("--out").arg(out).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(run.status.success(), "{args:?}\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    stdout
}

fn chromium() -> Option<&'static str> {
    let found = ["/usr/bin/chromium", "/usr/bin/chromium-browser"].into_iter().find(|p| Path::new(p).exists());
    if found.is_none() {
        assert!(std::env::var("RECKON_REQUIRE_BROWSER").as_deref() != Ok("1"), "RECKON_REQUIRE_BROWSER=1 but Chromium is not installed (scripts/setup-clients)");
        eprintln!("note: Chromium not installed; the report's browser check is skipped (scripts/setup-clients installs it)");
    }
    found
}

/// Headless Chromium with a fresh profile and no background network (this machine's network is closed).
fn headless(browser: &str, profile: &Path) -> Command {
    let mut c = Command::new(browser);
    c.args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]);
    c.arg(format!("--user-data-dir={}", profile.display()));
    c
}

#[test]
fn lab_report_shows_every_leg_and_renders_in_a_browser() {
    if !common::default_model_fetched() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("reckon-lab-report-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(&text, "The engine keeps every request's keys and values in blocks of sixteen tokens; when memory runs short the newest request waits. ".repeat(20)).unwrap();
    let text = text.to_str().unwrap();

    // eviction: 2 lengths x (full + 1 window) x 2 needles, and the fluency of full, window, window without sinks
    let ev = dir.join("eviction");
    let stdout = reckon(&["lab", "eviction", "--lengths", "160,320", "--windows", "64", "--needles", "2", "--max-tokens", "6", "--fluency-tokens", "300", "--text", text], &ev);
    let records = std::fs::read_to_string(ev.join("recall.jsonl")).unwrap();
    assert_eq!(records.lines().count(), 2 * 2 * 2, "{records}");
    let fluency: Vec<serde_json::Value> = std::fs::read_to_string(ev.join("fluency.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(fluency.len(), 3);
    assert!(fluency.iter().all(|f| f["perplexity"].as_f64().unwrap() > 1.0));
    assert!(stdout.contains("| window 64 + 4 sinks |") && stdout.contains("Fluency past the window"), "{stdout}");
    // a second leg beside it
    let kv = dir.join("kv-quant");
    reckon(&["lab", "kv-quant", "--arms", "f16,q8_0", "--depths", "0,64", "-r", "1", "-n", "4", "-p", "16", "--quality-tokens", "100", "--text", text], &kv);

    let run = Command::new(env!("CARGO_BIN_EXE_reckon")).args(["lab", "report", "--html"]).arg(&dir).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(md.contains("## eviction (eviction)") && md.contains("## kv-quant (kv-quant)"), "{md}");
    assert!(md.contains("lab eviction --lengths 160,320") && md.contains("cpu: ") && md.contains("![recall.svg](eviction/recall.svg)"), "{md}");
    let html = std::fs::read_to_string(dir.join("report.html")).unwrap();
    assert_eq!(html.matches("<svg class=\"plot\"").count(), 2, "recall.svg and speed.svg inline");
    assert!(html.contains("<th>arm</th>") && html.contains("window 64 + 4 sinks"));
    for outside in ["src=\"http", "href=\"http", "<link", "<img"] {
        assert!(!html.contains(outside), "the page loads {outside}...");
    }

    let Some(browser) = chromium() else { return };
    let page = format!("file://{}", dir.join("report.html").display());
    // the page's own check, after load: every plot drawn with a size
    let dom = headless(browser, &dir.join("profile-dom")).args(["--virtual-time-budget=5000", "--dump-dom"]).arg(&page).output().unwrap();
    let dom = String::from_utf8_lossy(&dom.stdout);
    assert!(dom.contains("2 of 2 plots rendered") && dom.contains("data-ok=\"1\""), "plots not rendered:\n{}", &dom[dom.len().saturating_sub(400)..]);
    assert_eq!(dom.matches("data-rendered=\"1\"").count(), 2);
    // and what a reader sees is not blank: many non-white pixels, and the plots' colours
    let shot = dir.join("shot.png");
    let run = headless(browser, &dir.join("profile-shot")).args(["--window-size=1200,2400", "--virtual-time-budget=5000"]).arg(format!("--screenshot={}", shot.display())).arg(&page).output().unwrap();
    assert!(shot.exists(), "no screenshot: {}", String::from_utf8_lossy(&run.stderr));
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&shot).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    let pixels: Vec<&[u8]> = buf[..info.buffer_size()].chunks_exact(channels).collect();
    let ink = pixels.iter().filter(|p| p[..3].iter().any(|&c| c < 200)).count();
    let red = pixels.iter().filter(|p| p[0] > 200 && p[1] < 80 && p[2] < 80).count();
    let blue = pixels.iter().filter(|p| p[2] > 200 && p[0] < 80 && p[1] < 80).count();
    assert!(ink > pixels.len() / 100, "the screenshot is almost blank: {ink} of {} pixels", pixels.len());
    assert!(red > 50 && blue > 50, "the plots' lines are not on the screenshot (red {red}, blue {blue})");
    std::fs::remove_dir_all(&dir).unwrap();
}
