// Builds the console into src/dsec/console/assets/ (index.html, app.js, app.css).
// Run from anywhere: paths are resolved against this file. Exits non-zero on any error.
import { build } from 'esbuild';
import { copyFile, mkdir, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, '..', 'src', 'dsec', 'console', 'assets');

async function main() {
  await mkdir(out, { recursive: true });
  // A stale source map or chunk from an older build must not be served.
  await rm(join(out, 'app.js.map'), { force: true });
  const result = await build({
    entryPoints: [join(here, 'src', 'main.js')],
    outfile: join(out, 'app.js'),
    bundle: true,
    format: 'esm',
    minify: true,
    target: 'es2020',
    platform: 'browser',
    legalComments: 'none',
    logLevel: 'warning',
    define: { 'process.env.NODE_ENV': '"production"' },
  });
  if (result.errors.length || result.warnings.length) {
    throw new Error(`esbuild: ${result.errors.length} errors, ${result.warnings.length} warnings`);
  }
  await copyFile(join(here, 'index.html'), join(out, 'index.html'));
  await copyFile(join(here, 'src', 'style.css'), join(out, 'app.css'));
  // The bundle carries these packages' code; their licences go with it (served at /ui/assets/LICENSES.txt).
  const notices = [];
  for (const name of ['preact', 'htm', 'chart.js']) {
    const pkg = JSON.parse(await readFile(join(here, 'node_modules', name, 'package.json'), 'utf8'));
    const dir = join(here, 'node_modules', name);
    const file = (await readdir(dir)).find((f) => /^licen[cs]e(\.md|\.txt)?$/i.test(f));
    if (!file) throw new Error(`no licence file in ${dir}`);
    const text = await readFile(join(dir, file), 'utf8');
    notices.push(`${name} ${pkg.version} (${pkg.license})\n\n${text.trim()}\n`);
  }
  await writeFile(join(out, 'LICENSES.txt'), notices.join('\n' + '-'.repeat(72) + '\n\n'));
  console.log(`console built into ${out}`);
}

main().catch((err) => {
  console.error(err && err.message ? err.message : err);
  process.exit(1);
});
