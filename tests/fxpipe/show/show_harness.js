// Minimal DOM stand-in: runs the page script under node and drives its buttons.
const fs = require('fs');
const [page, out] = [process.argv[2], process.argv[3]];
const html = fs.readFileSync(page, 'utf8');
const data = html.match(/<script type="application\/json" id="fxpipe-data">([\s\S]*?)<\/script>/)[1];
const script = html.match(/<script>([\s\S]*?)<\/script>\s*<\/body>/)[1];
const els = {};
function el(id) {
  if (!els[id]) els[id] = {id, innerHTML: '', textContent: id === 'fxpipe-data' ? data : '', style: {},
    clientWidth: 1200, attrs: {}, handlers: {}, className: '',
    setAttribute(k, v) { this.attrs[k] = String(v); }, removeAttribute(k) { delete this.attrs[k]; },
    addEventListener(k, f) { this.handlers[k] = f; },
    parentNode: {insertBefore() {}}};
  return els[id];
}
global.document = {getElementById: el, createElement: () => el('_new' + Math.random())};
eval(script);
const g = el('graph');
const report = {initial: g.innerHTML.length, boxesInitial: (g.innerHTML.match(/class="node"/g) || []).length};
function click(id, kind) { g.handlers[kind]({target: {closest: () => ({getAttribute: () => id})}}); }
click('g0', 'click');
report.afterExpandOne = (g.innerHTML.match(/class="node"/g) || []).length;
el('expand-all').onclick();
report.expandedAll = (g.innerHTML.match(/class="node"/g) || []).length;
report.expandedHtml = g.innerHTML;
click('n0', 'dblclick');
report.afterCollapseOne = (g.innerHTML.match(/class="node"/g) || []).length;
el('collapse-all').onclick();
report.collapsedAll = (g.innerHTML.match(/class="node"/g) || []).length;
el('wrap').onclick(); el('fit').onclick();
report.oneRowWidth = g.attrs.width;
report.timeline = el('tl-sim').innerHTML.length;
report.measured = el('tl-measured').innerHTML.length;
report.info = el('graph-info').textContent;
fs.writeFileSync(out, JSON.stringify(report));
