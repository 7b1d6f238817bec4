// Copy the console's browser libraries from node_modules (`npm ci` installs the versions that
// package-lock.json pins) into static/vendor, and write static/vendor/MANIFEST.json with each
// file's package, version and SHA-256. The copies are committed: the gateway serves them, and
// Python needs no Node.js. tests/test_console_assets.py checks the manifest against the lock and
// the files, and (where npm is installed) the files against a fresh `npm ci`.
import { createHash } from "node:crypto";
import { copyFileSync, readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
// [package, file inside it, name under static/vendor]
const FILES = [
  ["chart.js", "dist/chart.umd.min.js", "chart.umd.min.js"],
  ["chart.js", "LICENSE.md", "chart.js.LICENSE.md"],
  ["@picocss/pico", "css/pico.min.css", "pico.min.css"],
  ["@picocss/pico", "LICENSE.md", "pico.LICENSE.md"],
];

const manifest = {};
for (const [pkg, source, target] of FILES) {
  const root = join(here, "node_modules", pkg);
  const { version } = JSON.parse(readFileSync(join(root, "package.json"), "utf8"));
  copyFileSync(join(root, source), join(here, "static", "vendor", target));
  const sha256 = createHash("sha256").update(readFileSync(join(root, source))).digest("hex");
  manifest[target] = { package: pkg, version, source, sha256 };
}
writeFileSync(join(here, "static", "vendor", "MANIFEST.json"), JSON.stringify(manifest, null, 2) + "\n");
console.log(`vendored ${FILES.length} files into static/vendor`);
