// Loaded just before the ipywidgets html-manager (embed-amd.js), on pages whose notebook stores
// widget state (see nb_ipywidgets_js in _config.yml), before require.js. Two adjustments let it
// work offline:
(function () {
  "use strict";

  // 1. Its icon fonts, vendored next to embed-amd.js by `make static`, are found through the
  //    require.js path of its inner module; by default that path is relative to the page. The
  //    directory comes from this script tag's data-html-manager (relative to _static/).
  const here = document.currentScript;
  const dir = new URL(here.dataset.htmlManager.replace(/\/?$/, "/"), here.src).href;
  const paths = { "@jupyter-widgets/html-manager/dist": dir.slice(0, -1) };
  if (typeof window.require === "function") {
    window.require.config({ paths });
  } else {
    window.require = { paths }; // read by require.js when it loads, just after this script
  }
  window.__jupyter_widgets_assets_path__ = dir;

  // 2. It typesets widget labels with MathJax 2's MathJax.Hub.Queue(["Typeset", MathJax.Hub, el]);
  //    the book loads MathJax 3 (typesetPromise). MathJax 3 replaces window.MathJax when it loads
  //    (deferred, so after this script), hence the shim goes on the config object before and on the
  //    real object from startup.ready. Without MathJax on the page, widgets skip typesetting.
  const hub = {
    Queue(...jobs) {
      for (const job of jobs) {
        const mathjax = window.MathJax;
        if (Array.isArray(job) && job[0] === "Typeset" && mathjax && mathjax.typesetPromise) {
          mathjax.typesetPromise(job[2] ? [job[2]] : undefined).catch((err) => console.warn(err));
        }
        // before MathJax 3 has loaded, its first pass typesets the whole page anyway
      }
    },
  };
  const addHub = (obj) => Object.defineProperty(obj, "Hub", { value: hub, configurable: true });
  const mathjax = window.MathJax;
  if (mathjax && mathjax.version) {
    addHub(mathjax);
  } else if (mathjax) {
    addHub(mathjax);
    mathjax.startup = mathjax.startup || {};
    const ready = mathjax.startup.ready;
    mathjax.startup.ready = () => {
      addHub(window.MathJax);
      return ready ? ready() : window.MathJax.startup.defaultReady();
    };
  }
})();
