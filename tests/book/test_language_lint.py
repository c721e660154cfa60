"""tools/lint_language.py: each rule catches the bad form and passes the good one; the repository is clean.

The examples are small strings and notebook dicts; the last test lints the whole repository (what
`make lint` runs) and fails while a translation or a tr() string is still missing.
"""

import json
import textwrap
from pathlib import Path

import lint_language as lint
import pytest
from lint_language import Text

ROOT = Path(__file__).resolve().parents[2]
NBSP = "\u00a0"


def code_findings(source: str) -> list[str]:
    return [text for _, text in lint.untranslated(lint.strip_magics(textwrap.dedent(source)))]


def term_findings(lang: str, text: str, kind: str = "prose", path: str = "chapters/xx/99-test.ipynb") -> list[str]:
    return [f.message for f in lint.check_terms_text(Text(path, "cell 2", kind, text), lang)]


def typography(lang: str, markdown: str, kind: str = "prose") -> list[str]:
    texts = lint.prose_blocks(markdown) if kind in ("prose", "notes") else [markdown]
    return [f.message for t in texts for f in lint.check_typography_text(Text("x.ipynb", "cell 2", kind, t), lang)]


def notebook(*cells: dict, lang: str = "ru") -> dict:
    metadata = {"distcourse": {"translation": {"language": lang}}} if lang != "en" else {}
    return {"cells": list(cells), "metadata": metadata, "nbformat": 4, "nbformat_minor": 5}


def markdown_cell(source: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": source}


def code_cell(source: str, outputs=()) -> dict:
    return {"cell_type": "code", "metadata": {}, "source": source, "outputs": list(outputs), "execution_count": None}


def stdout(text: str) -> dict:
    return {"output_type": "stream", "name": "stdout", "text": text}


# ---------------------------------------------------------------- rule: code


@pytest.mark.parametrize(
    "bad",
    [
        'print(f"replicas identical; largest difference {gap:.1e}")',
        'print("with Join: done in " + str(seconds) + " s")',
        """print(f"rank {r}: {'SAME' if same else 'different from rank 0'}")""",
        'say(rank, f"step {step} finished on the slow rank")',
        'ax.set_ylabel("seconds")',  # figure text: one English word is enough
        'ax.plot(x, y, label="measured")',
        'ax.barh(["1 process", "TP"], values)',
        'display(Markdown(markdown_table(["rank", "node on 2×2"], rows)))',
        'label = "1 rank x 2 threads"\nprint(label)',
        'clock["1-2. formats, loss scaling"] = time.perf_counter() - started',
        '%%time\nprint("the ranks agree with each other")',
        'sys.stdout.write(f"resumed from step {step}\\n")',
    ],
)
def test_code_catches_english_that_skips_tr(bad):
    assert code_findings(bad), bad


@pytest.mark.parametrize(
    "good",
    [
        'print(tr("replicas identical; largest difference {gap}").format(gap=number(gap, 1)))',
        'print(tr("with Join: done in {seconds} s").format(seconds=number(seconds, 2)))',
        'print(f"num_workers={n}: {rate:.0f}")',  # identifiers and numbers
        'print("all-reduce", "reduce-scatter", "forward/backward")',  # collective and op names
        'print(f"{name:16s} {seconds:6.2f} ms")',  # format fields and units
        'print("TP + SP:", sp)',  # acronyms
        'ax.set_ylabel(tr("seconds"))',
        'ax.legend(loc="upper left", fontsize=8)',  # options, not text
        'print(f"rank {r}:")',  # one word is not a sentence
        'sample = generate(model, "Distributed training ", 160)\nprint(sample)',  # the model writes it
        'if "closing signal" in line:\n    print(line)',  # a key searched for, not shown
        'print(json.dumps({"world size": 2, "tokens per second": 3.5}))',  # a machine-readable line
        'clock[tr("1-2. formats, loss scaling")] = time.perf_counter() - started',
        'raise ValueError("world size must be positive")',  # not printed by the course
        'print(f"join: {waits.join}  close: {waits.close}  heartbeat: {waits.heartbeat}")',  # field names
    ],
)
def test_code_passes_translated_or_technical_text(good):
    assert code_findings(good) == [], good


def test_code_checks_english_notebooks_and_reports_cells(tmp_path):
    path = tmp_path / "chapters" / "en" / "99-test.ipynb"
    path.parent.mkdir(parents=True)
    setup = code_cell('print("the setup cell comes from tools/headers.py")')
    nb = notebook(markdown_cell("# Title"), setup, code_cell('print("every rank has the same weights")'), lang="en")
    path.write_text(json.dumps(nb), encoding="utf-8")
    findings = lint.lint_paths([path], {"code"})
    assert [(f.where, f.rule) for f in findings] == [("cell 2", "code")]
    assert str(findings[0]) == f"{path}:cell 2: code: English text without tr(): 'every rank has the same weights'"


def test_english_words_skip_identifiers_units_and_fields():
    text = "dist.get_rank() --nnodes=2 DDP FSDP2 all-reduce {n:,} ms the loss `x y`"
    assert lint.english_words(text) == ["the", "loss"]


# ---------------------------------------------------------------- rule: terms


@pytest.mark.parametrize(
    "lang, bad, good",
    [
        ("ru", "Ранг, у которого функция потерь стала NaN.", "Ранг, у которого потери стали NaN."),
        ("ru", "проверяйте функцию потерь на каждом ранге", "функцию потерь вычисляет каждый ранг"),
        ("ru", "на модели из 124M параметров", "на модели из 124 млн параметров"),
        ("ru", "пишите в лог время ожидания", "пишите в журнал время ожидания"),
        ("zh-CN", "bf16 autocast 和激活值检查点作为命令行选项", "bf16 autocast 和激活检查点作为命令行选项"),
        ("zh-CN", "在执行优化步骤之前", "在执行优化器步骤之前"),
        ("zh-TW", "本章第一部分在兩個節點上啟動了工作。", "本章第一部分在兩個節點上啟動了作業，工作行程各一個。"),
        ("zh-TW", "預設的記憶體（内存）", "預設的記憶體"),
        ("zh-TW", "排程器的日誌", "排程器的記錄檔"),
        ("pt-BR", "TP dentro do nó e FSDP2 entre nós", "TP dentro do nó e FSDP2 entre os nós"),
        ("pt-BR", "erros que não levantam nada", "erros que não lançam nenhuma exceção"),
        ("pt-BR", "um modelo de 70B parâmetros", "um modelo de 70B de parâmetros"),
        ("ko", "스텝 {step}에서 재개(에포크 {epoch})", "스텝 {step}에서 재개(에폭 {epoch})"),
        ("ko", "텐서의 값에 의존하는 Python 코드", "텐서의 값에 의존하는 파이썬 코드(Python 3.13까지)"),
        ("ko", "모든 복제본이 같은 스텝을 밟습니다", "모든 복제본이 같은 스텝을 실행합니다"),
        ("ru", "момент SGD и моменты Adam", "импульс (momentum) SGD и моменты Adam"),
        ("ru", "отображайте тензоры на устройство ранга", "загружайте тензоры на устройство ранга"),
        ("ru", "срез по dim 0", "срез по размерности 0"),
        ("ru", "собственная группа процессов для сохранений", "отдельная группа процессов для сохранений"),
        ("zh-CN", "页锁定内存", "锁页内存"),
        ("zh-TW", "配套程式碼", "隨附程式碼"),
        ("zh-TW", "印出的串列", "印出的清單"),
        ("zh-TW", "這是最後一哩的最佳化", "這是收尾階段的微調"),
        ("zh-TW", "請懷疑防火牆", "很可能是防火牆"),
        ("zh-CN", "机器名相同", "主机名相同"),
        ("zh-CN", "挺过重启", "承受重启"),
        ("ko", "예외를 던집니다", "예외를 일으킵니다"),
        ("ko", "기대값과 최대값", "기댓값과 최댓값"),
        ("ko", "torchrun 아래에서 실행하면", "torchrun으로 실행하면"),
        ("pt-BR", "um resultado reproduzível", "um resultado reprodutível"),
        ("pt-BR", "uma checagem rápida", "uma verificação rápida"),
        ("pt-BR", "troca memória da GPU por tráfego PCIe", "economiza memória da GPU à custa de tráfego PCIe"),
        ("ru", "через хранилище ключ-значение", "через хранилище «ключ — значение»"),
        ("ru", "Знайте, что ранги не ждут", "Помните, что ранги не ждут"),
        ("ru", "ранги одной группы конвейера", "ранги одной конвейерной группы"),
        ("ru", "совпадает с непрерывным запуском", "совпадает с запуском без прерывания"),
        ("zh-CN", "这是最后一公里的优化", "这是收尾阶段的微调"),
        ("zh-CN", "每个论断都有一个 assert 来验证", "每个结论都用 assert 验证"),
        ("zh-TW", "Reduce-scatter 環節", "Reduce-scatter 階段"),
        ("zh-TW", "乾淨地失敗", "明確地報錯"),
        ("pt-BR", 'cada coluna "after" da tabela', 'cada coluna "depois" da tabela'),
        ("ko", "랭크마다 자기 디바이스를 씁니다", "랭크마다 디바이스가 따로 있습니다"),
        ("ko", "각 랭크가 자기만의 드롭아웃 마스크를", "자기회귀 모델에서 각 랭크가 자신의 드롭아웃 마스크를"),
        ("ko", "`dist.recv`가 오류를 던집니다", "`dist.recv`가 오류를 일으킵니다"),
        ("ko", "`DataLoader`가 예외를 발생합니다", "`DataLoader`에서 예외가 발생합니다"),
        ("pt-BR", 'a redução do FSDP sobre "dp" calcula', 'a redução do FSDP na dimensão "dp" calcula'),
        ("pt-BR", "a média sobre o eixo tp", "a média ao longo do eixo tp, um passo sobre o lote inteiro"),
        ("pt-BR", "O `PipelineStage` conhece o DDP", "O `PipelineStage` sabe lidar com o DDP e conhece o índice"),
        ("pt-BR", "## 4. Falhas sob o torchrun", "## 4. Falhas com o torchrun"),
        ("pt-BR", "Sob o FSDP2, cada rank guarda um shard", "Com o FSDP2, cada rank guarda um shard"),
        ("zh-CN", "这就是为什么每个 rank 都要调用 set_epoch。", "因此每个 rank 都要调用 set_epoch。为什么？"),
        ("zh-CN", "这也是为何要设超时。", "所以要设超时。"),
        ("zh-TW", "這就是為什麼這個儲存格去詢問裝置", "所以這個儲存格直接向裝置查詢"),
        ("ru", "процессы стартуют из ячеек Jupyter-ноутбука", "процессы стартуют из ячеек ноутбука, а ядро Jupyter"),
        ("ru", "как и скрипт под torchrun", "как и скрипт, запущенный через torchrun"),
        ("zh-CN", "<summary>练习 1 的答案</summary>", "<summary>练习 1 的参考答案</summary>"),
        ("zh-TW", "僅限於同一個檔案系統內，這就是第 1 步的原因", "第 1 步正是為此：僅限於同一個檔案系統內"),
        ("ru", "ранги продолжают с последней контрольной точки", "ранги продолжают обучение с последней точки"),
        ("ru", "скопируйте файлы в одну папку", "скопируйте файлы в один каталог"),
        ("ru", "порядок с единичными стоимостями", "порядок с условными стоимостями"),
        ("ru", "каждый ранг сбрасывает свой Flight Recorder", "каждый ранг записывает дамп своего Flight Recorder"),
        ("zh-CN", "见第 39-49 行", "见第 39～49 行"),
        ("zh-CN", "一个 2×2 的网格", "一个 2 × 2 的网格"),
        ("zh-CN", "查询这块 GPU 的档案", "查询这块 GPU 的规格"),
        ("zh-CN", "DeepSpeed（ZeRO 阶段 2）", "DeepSpeed（ZeRO-2）"),
        ("zh-CN", "得先编译才能用", "需要先编译才能使用"),
        ("zh-TW", "記憶體剖析工具做不到", "記憶體剖析器做不到"),
        ("zh-TW", "走完一步之後逐一清點", "訓練一步之後逐一清點"),
        ("zh-TW", "彈性成員資格", "節點組成的變動"),
        ("zh-TW", "在第 1-2 階段則不同", "在第 1 與第 2 階段則不同"),
        ("pt-BR", "com o seu logging e a avaliação", "com o registro de logs e a avaliação"),
        ("pt-BR", "as ferramentas do lado da GPU", "as ferramentas para GPU"),
        ("pt-BR", "o NCCL inicia dentro dele", "o NCCL é inicializado dentro dessa chamada"),
        ("ko", "워커를 일부러 크래시시키고", "워커 하나에 일부러 크래시를 일으키고"),
        ("ko", "CPU에서의 속도는 레이아웃보다", "CPU에서 잰 속도는 레이아웃보다"),
        ("ru", "измерите, почему `nn.DataParallel` медленный", "измерите, из чего складывается шаг, и поймёте, почему"),
        ("ru", "запуск обучает оба варианта", "в обоих вариантах модель обучается"),
        ("ru", "**Ваш собственный текст.**", "**Свой текст.**"),
        ("pt-BR", "eles são DTensors na malha de dp", "eles são objetos `DTensor` na malha de dp"),
        ("pt-BR", "divisões em float de números inteiros", "divisões de inteiros em ponto flutuante"),
        ("zh-TW", "兩個核心上跑四個 rank", "兩個核心上跑 4 個 rank"),
        ("zh-TW", "把它停掉", "將它終止"),
        ("ko", "DataLoader 자체도 전역 RNG를 씁니다", "DataLoader 자체도 전역 생성기를 씁니다"),
        ("ko", "워커들에게 상태를 보냅니다", "워커들에 상태를 보냅니다"),
        ("ko", "모든 주장은 `assert`로 검증됩니다.", "모든 주장은 `assert`로 확인합니다."),
        ("ru", "каждый ранг держит две стадии поменьше", "каждый ранг держит две стадии меньшего размера"),
        ("ru", "накапливает нередуцированные градиенты", "накапливает градиенты без редукции"),
        ("ru", "перестают помещаться на одно устройство", "перестают помещаться в память одного устройства"),
        ("zh-TW", "誰在 fp16 下看過損失變成 NaN", "誰用 fp16 訓練時看過損失變成 NaN"),
        ("zh-TW", "（「implicit prefetching」，即隱式預取）", "（即隱式預取，implicit prefetching）"),
        ("zh-TW", "所有部件一起上場", "所有元件一起上場"),
        ("pt-BR", "Trace o gráfico da sobreposição", "Faça o gráfico da sobreposição"),
        ("pt-BR", "um nó que chega depois se junta a ele", "um nó que chegar depois se junta a ele"),
        ("zh-CN", "每个 rank 都带来自己的设备", "每个 rank 各有一块自己的设备"),
        ("zh-CN", "也得靠 `static_graph=True`", "也需要 `static_graph=True`"),
        ("zh-CN", "像被内核的 OOM killer 杀掉", "像被操作系统内核的 OOM killer 杀掉"),
        ("zh-CN", "所有进程都通过一个 barrier", "所有 rank 在 barrier 处会合"),
        ("ko", "스케줄은 버블과 메모리 사이에서 균형을 잡습니다", "스케줄은 버블과 메모리를 맞바꿉니다"),
        ("ko", "호스트 메모리로의 복사", "호스트 메모리로 복사합니다"),
        ("zh-TW", "記憶體上的優勢，正是 1F1B 成為常見選擇的原因", "1F1B 之所以成為常見選擇，正是因為記憶體上的優勢"),
        ("zh-TW", "分析工具以 `KeyError` 中止", "分析工具因 `KeyError` 而中止"),
        ("zh-TW", "先暖機一次", "先暖身一次"),
        ("zh-CN", "用一次休眠来代表更慢的 GPU", "用一次休眠来模拟更慢的 GPU"),
        ("zh-CN", "于是把专家分布到多块 GPU 上，称为**专家并行**", "于是把专家分布到多块 GPU 上，这就是**专家并行**"),
        ("zh-TW", "時間零點在通過 barrier 後取得", "時間零點是兩個 rank 在 barrier 會合後記下的"),
        ("zh-TW", "能把真正的卡住轉變成錯誤", "真正卡住時能及時報錯"),
        ("pt-BR", "o lado Python de cada operação", "a parte em Python de cada operação"),
        ("pt-BR", "O padrão, `None`, equivale a `True`", "O valor padrão, `None`, equivale a `True`"),
        ("ko", "5개가 있다고 해 봅시다.", "5개가 있다고 가정합니다."),
        ("ko", "어떤 오류가 나며", "어떤 오류가 발생하며"),
        ("ru", "LOCAL_RANK не уникален между машинами", "LOCAL_RANK на разных машинах принимает одни и те же значения"),
        ("ru", "Напишите функцию `f(x)`: она должна вернуть", "Напишите функцию `f(x)`, которая возвращает"),
        ("zh-CN", "world_size 必须至少为 1", "world_size 不能小于 1"),
        ("zh-TW", "驗證這個算術", "驗證這個計算"),
        ("zh-TW", "假設通訊完全藏在其後", "假設通訊完全與運算重疊"),
        ("zh-TW", "第四次 all-reduce", "第 4 次 all-reduce"),
        ("ko", "오류가 전혀 나지 않습니다", "오류가 전혀 발생하지 않습니다"),
        ("ko", "AdamW의 첫 스텝들은", "AdamW는 처음 몇 스텝에서"),
        ("pt-BR", "um processo que nunca tocou no CUDA", "um processo que nunca usou o CUDA"),
        (
            "ru",
            "Напишите ниже `my_atomic_save(obj, path)`: сохраните",
            "Напишите ниже функцию `my_atomic_save(obj, path)`, которая",
        ),
        ("ru", "с моделью побольше", "с более крупной моделью"),
        ("zh-TW", "與完整批次那一步的最大差異", "與整個批次那一步的最大差異"),
        ("zh-TW", "用三個訓練者執行", "用 3 個訓練者執行"),
        ("ko", "이 머신 안에서의 랭크", "이 머신 안의 랭크"),
        ("zh-CN", "TP 的集合通信不会隐藏在计算背后", "TP 的集合通信不会被计算掩盖"),
        ("zh-CN", "Gloo 可以在 CPU 张量上运行", "gloo 可以在 CPU 张量上运行"),
        ("pt-BR", "A execução A treina 40 passos", "A execução A faz 40 passos de treinamento"),
        ("pt-BR", "kernels de atenção da CUDA", "kernels de atenção do CUDA"),
        ("zh-TW", "量測 `nn.DataParallel` 為什麼慢", "實際量測 `nn.DataParallel` 慢在哪裡"),
        ("ru", "размер батча задан на процесс", "размер батча указан в расчёте на один процесс"),
        ("ru", "В большом масштабе записывайте", "В больших заданиях записывайте"),
        ("ko", "차이만큼을 all-reduce 안에서 기다리며 보냅니다", "차이만큼 all-reduce에서 기다립니다"),
        ("zh-CN", "复制到同一个文件夹中", "复制到同一个目录中"),
        ("pt-BR", "trocam dados entre ranks", "trocam dados entre os ranks"),
        (
            "ru",
            "Ничего не падает: задание работает медленнее",
            "Ошибки при этом не возникает: задание работает медленнее",
        ),
        ("ru", "при равенстве выбирает меньший ранг", "при равном времени выбирает ранг с меньшим номером"),
        ("zh-TW", "每個 rank 都帶來自己的裝置", "每個 rank 都有自己的裝置"),
        ("zh-TW", "讓每個 rank 持有所有東西", "讓每個 rank 持有全部狀態"),
        ("ko", "타임아웃이 나면 덤프합니다", "타임아웃이 발생하면 덤프합니다"),
        ("zh-CN", "第 02 到 04 章", "第 02～04 章"),
        ("zh-CN", "切分带来了什么：每个设备", "切分的收益：每个设备"),
        ("pt-BR", "todo tensor foi salvo a partir de `cpu`", "todo tensor estava em `cpu` quando foi salvo"),
        ("pt-BR", "A diferença minúscula é arredondamento", "A diferença minúscula vem do arredondamento"),
        ("ru", "ранг 1 падает с понятной ошибкой", "ранг 1 завершается с понятной ошибкой"),
        ("ru", "как выглядит такой файл, показывает раздел 4", "как выглядит такой файл, показано в разделе 4"),
        ("ru", "минимум флагов «значение конечно»", "минимум флагов `isfinite`"),
        ("ru", "последовательности дополнены паддингом", "последовательности дополнены до общей длины (padding)"),
        ("ru", "второй поток в каждом ранге ждёт", "второй поток на каждом ранге ждёт"),
        ("ru", "запуски выше его передают", "в запусках выше он передан"),
        ("pt-BR", "O padrão de 25 MiB é um meio-termo", "O valor padrão de 25 MiB é um meio-termo"),
        ("zh-TW", "TP 的集合通訊不會藏在計算後面", "TP 的集合通訊無法與計算重疊"),
        ("zh-TW", "在預設的 `broadcast_buffers=True` 之下還會複製", "在預設的 `broadcast_buffers=True` 設定下還會複製"),
        ("zh-TW", "先談數值格式（第 1-4 節）", "先談數值格式（第 1 至 4 節）"),
        ("zh-TW", "兩種方式都有額外負擔", "兩種方式都有額外開銷"),
        ("zh-TW", "讓我們啟動 4 個 rank", "接下來啟動 4 個 rank"),
        ("zh-TW", "沒有例外、沒有任何清理", "不拋出例外，也不做任何清理"),
        ("zh-TW", "由第二個執行緒監看看門狗", "由第二個執行緒監控看門狗"),
        ("pt-BR", "o rank 0 espera num all-reduce", "o rank 0 espera em um all-reduce"),
        ("pt-BR", "os padrões são de minutos", "os valores padrão são de minutos"),
        ("pt-BR", "todo rank lança um erro", "todo rank lança uma exceção"),
        ("pt-BR", "o script batch do SLURM", "o script de submissão do SLURM"),
        ("pt-BR", "o launcher nomeia o rank", "o launcher indica o rank"),
        ("ko", "손실은 부동소수점 반올림 범위 안에서 같습니다", "손실은 부동소수점 반올림 오차 범위 안에서 같습니다"),
        ("ko", "결과는 eager와 반올림만큼만 다릅니다", "결과는 eager와 반올림 오차만큼만 다릅니다"),
        ("ko", "1-4절은 컴파일, 5-8절은 FSDP2 옵션", "1~4절은 컴파일, 5~8절은 FSDP2 옵션"),
        ("ko", "완전한 fp32로 계산하고", "fp32 정밀도 그대로 계산하고"),
        ("ko", "배치 전체를 워커에게 차례로 넘깁니다", "배치 전체를 워커에 차례로 넘깁니다"),
        ("ru", "крошечная разница — это округление", "крошечная разница — это ошибка округления"),
        (
            "ru",
            "Напишите `find_slow_rank(per_rank)`: по замерам",
            "Напишите функцию `find_slow_rank(per_rank)`, которая",
        ),
        ("ru", "в сумме с плавающей точкой", "в сумме чисел с плавающей точкой"),
        ("ru", "вычисления и коммуникация идут бок о бок", "вычисления и коммуникация выполняются параллельно"),
        ("ru", "контрольная точка двух рангов", "контрольная точка, записанная двумя рангами"),
        ("zh-CN", "一个 3.2M 参数的 MLP", "一个有 320 万个参数的 MLP"),
        ("zh-CN", "最新的检查点文件夹", "最新的检查点目录"),
        ("zh-CN", "前向与反向并排运行", "前向与反向同时运行"),
        ("zh-TW", "在 FSDP2 下每個 rank 只持有", "使用 FSDP2 時，每個 rank 只持有"),
        ("zh-TW", "而沒有任何東西需要它的結果", "而反向傳播用不到它的結果"),
        ("zh-TW", "工作行程死掉時", "工作行程終止時"),
        ("zh-TW", "Linux 上 Python 3.13 以前是 fork", "Linux 上到 Python 3.13 為止是 fork"),
        ("pt-BR", "cada rank traz o seu próprio dispositivo", "cada rank tem o seu próprio dispositivo"),
        ("pt-BR", "o otimizador (ZeRO estágio 2)", "o otimizador (estágio 2 do ZeRO)"),
        ("pt-BR", "envolve o modelo em DDP", "envolve o modelo no DDP"),
        ("pt-BR", "a operação no coração do paralelismo", "a operação central do paralelismo"),
        ("pt-BR", "os biases das LayerNorms", "os vieses das LayerNorms"),
        ("ko", '"...available"이라고 하고', '"...available"라고 하고'),
        ("ko", "런처에게 맡기면", "런처에 맡기면"),
        ("ko", "랭크의 이름을 알려 줍니다", "어느 랭크인지 알려 줍니다"),
        ("ru", "операции под autocast", "операции в режиме autocast"),
        ("ru", "на CPU обычного ноутбука", "на CPU обычного компьютера, в ячейке ноутбука"),
        ("ru", "как тренер в torchtitan", "как обучающий скрипт (trainer) в torchtitan"),
        ("ru", "до округления float", "с точностью до округления"),
        ("ru", "значение потерь не конечно", "значение потерь — NaN или inf"),
        ("ru", "ранги висят до тайм-аута", "ранги зависают до тайм-аута"),
        ("zh-CN", "训练 3 个 AdamW 步骤", "用 AdamW 训练 3 步"),
        ("zh-CN", "输出层对 logits 做收集", "输出层收集 logits"),
        ("zh-TW", "計算能力 8.9 或更新", "計算能力 8.9 以上"),
        ("zh-TW", "好讓頁面保持快速", "好讓整頁很快就能執行完"),
        ("pt-BR", "o lançador não muda nada", "o launcher não muda nada"),
        ("pt-BR", "a menos de arredondamento de float", "a menos de arredondamento de ponto flutuante (float64)"),
        ("pt-BR", "coincidem até cerca de 10", "coincidem com diferenças da ordem de 10"),
        ("pt-BR", "Envolver o modelo leva uma linha", "Para envolver o modelo, basta uma linha"),
        ("pt-BR", "pode se tornar ela mesma o gargalo", "pode se tornar o próprio gargalo"),
        ("ko", "`PipelineStage`는 DDP를 알고 있어서", "`PipelineStage`는 DDP로 감싼 모듈을 알아보고"),
        ("ru", "Если рабочий процесс падает, агенты", "Если рабочий процесс аварийно завершается, агенты"),
        ("ru", "Лаунчер видит упавший ранг", "Лаунчер видит ранг, завершившийся сбоем"),
        ("ru", "намеренно уроните рабочий процесс", "намеренно вызовите сбой рабочего процесса"),
        ("zh-CN", "变量未设置、且一个节点上", "变量未设置且一个节点上"),
        ("zh-CN", "比较每一步的总耗时什么也找不到", "比较每一步的总耗时看不出任何异常"),
        ("zh-TW", "這些代理程式會找到彼此", "這些代理程式會互相聯繫上"),
        ("zh-TW", "torch 2.13 以後的版本會指出", "從 torch 2.13 起會指出"),
        ("zh-TW", "然後以錯誤結束", "然後報錯結束"),
        ("ko", "오프로드하면 무엇을 얻는지 계산합니다", "오프로드하면 얼마나 이득인지 계산합니다"),
        ("ko", "다른 접두사 아래에서 서로를 찾다가", "서로 다른 접두사에서 상대를 찾다가"),
        ("ko", "똑같이 21스텝 학습합니다", "똑같이 21스텝 동안 학습합니다"),
        ("pt-BR", "as duas voltam ao Python na hora", "as duas retornam imediatamente ao Python"),
        ("pt-BR", "iguais até o arredondamento de float64", "iguais a menos do arredondamento de float64"),
        ("pt-BR", "compute capability 8.9 ou mais nova", "compute capability 8.9 ou superior"),
        (
            "ru",
            "градиенты реплик суммируются обратно на GPU 0",
            "градиенты реплик возвращаются на GPU 0 и суммируются там",
        ),
        ("ru", "## 3. Тихие ошибки", "## 3. Незаметные ошибки"),
        ("zh-CN", "更新在 fp32 中进行", "以 fp32 执行更新"),
        ("zh-CN", "更大的单 GPU 批次", "每块 GPU 上更大的批次"),
        (
            "zh-TW",
            "與本課程其他所有地方不同，這份腳本使用固定的連接埠",
            "這份腳本使用固定的連接埠，這是本課程唯一的例外",
        ),
        ("zh-TW", "重疊可以隱藏 all-reduce 的大部分時間", "重疊可以掩蓋 all-reduce 的大部分時間"),
        ("ko", "랭크 2개에서의 노름", "랭크 2개로 구한 노름"),
        ("ko", "실패한 각 랭크가 각자의 예외와", "실패한 랭크는 저마다 예외와"),
        ("pt-BR", "O que o código lê de volta ganha uma linha", "O que o código vai ler da saída ganha uma linha"),
        ("pt-BR", "outro tamanho de paralelismo de dados", "outro grau de paralelismo de dados"),
        ("ru", "с одним потоком внутри операций", "с одним потоком intra-op"),
        ("ru", "(выше: гиперпараметры Adam)", "(в примере выше — гиперпараметры Adam)"),
        ("ru", "потери совпадают побитово", "потери совпадают бит в бит; побитовое сравнение"),
        ("zh-CN", "在真实的进程上运行", "在真正的进程上运行"),
        ("zh-CN", "无法访问的地址：所以脚本把", "无法访问的地址。这正是脚本把"),
        ("zh-TW", "2 × 2 配置下的節點", "2 × 2 佈局下的節點"),
        ("zh-TW", "1/√(variance + ε)", "1/√(變異數 + ε)"),
        ("ko", "**모델을 감쌉니다**: `DDP(model)`", "`DDP(model)`로 **모델을 감쌉니다**."),
        ("ko", "측정 결과가 보여 주는 것은 다음과 같습니다.", "측정 결과에서 다음을 알 수 있습니다."),
        ("pt-BR", "cada afirmação é um `assert`.", "cada afirmação é verificada por um `assert`."),
        ("pt-BR", "carregá-lo de volta em um único processo", "carregá-lo depois em um único processo"),
        ("pt-BR", "treinam três passos com Adam", "fazem três passos de treinamento com o Adam"),
        ("ko", "프로세스를 **중단**시킬 수 있습니다", "프로세스를 **비정상 종료**시킬 수 있습니다"),
        ("ko", "속도 향상 수치를 인용하고 싶은 유혹을 참으세요", "속도 향상 수치는 인용하지 마세요"),
        ("zh-CN", "编写 `find_slow_rank(per_rank)`：返回掉队者", "编写 `find_slow_rank(per_rank)`，返回掉队者"),
        ("zh-CN", "TensorPipe 已不再积极开发", "TensorPipe 已不再活跃开发"),
        ("zh-TW", "若 all-to-all 被隱藏（第二列）", "若 all-to-all 與計算重疊（第二列）"),
        ("zh-TW", "{total} 個中的 {dropped} 個", "{dropped} 個（共 {total} 個）"),
        ("zh-TW", "**自我檢查**。寫出 `f(x)`：根據", "**自我檢查**。寫出 `f(x)`，根據"),
        ("ko", "모든 쿼리가 앞선 모든 키를 필요로 합니다", "모든 쿼리에 앞선 모든 키가 필요합니다"),
        ("ko", "이 장의 공식들로부터 결정 표를", "이 장의 공식으로 결정 표를"),
        ("ko", "노출된 통신, 초", "드러난 통신, 초"),
        ("ko", "10스텝을 학습하고", "10스텝 동안 학습하고"),
        ("ko", "두 GPU를 모두 바쁘게 하려면", "두 GPU가 모두 쉬지 않게 하려면"),
        ("ko", "이상값: 워커당 10 ms마다 샘플 1개", "이상적인 경우: 워커당 10 ms마다 샘플 1개"),
        (
            "pt-BR",
            "Escreva `find_slow_rank(per_rank)`: o rank",
            "Escreva `find_slow_rank(per_rank)`, que retorna o rank",
        ),
        ("pt-BR", "(embedding, norma final, saída)", "(embedding, normalização final, saída)"),
        (
            "ru",
            "если ячейка на вашем ноутбуке завершается с ошибкой",
            "если на вашем компьютере ячейка завершается с ошибкой",
        ),
        ("ru", "запустите повседневный цикл обучения DDP", "запустите обычный цикл обучения DDP"),
        ("ru", "k микробатчей стоят k раундов коммуникации", "k микробатчей обходятся в k раундов коммуникации"),
        ("zh-CN", "本章第一个 notebook 介绍过", "本章第一部分介绍过"),
        ("zh-CN", "它恰好是 rank 0 只是偶然", "它是不是 rank 0 全凭偶然"),
        ("zh-CN", "每个这类条目只分配给一个 rank", "把每个这样的条目只交给一个 rank 写出"),
        (
            "zh-TW",
            "對於分片的張量，就是分片；對於一般張量，就是張量本身",
            "若是分片的張量，就是分片；若是一般張量，就是張量本身",
        ),
        ("zh-TW", "在 fp32 中，每個參數多 4 位元組", "使用 fp32 時，每個參數多 4 位元組"),
        ("zh-TW", "混合精度下為 2 位元組", "使用混合精度時為 2 位元組"),
        ("ko", "피크 성능에 현실적인 비율을 곱해", "최대 성능에 현실적인 비율을 곱한"),
        ("ko", "-6은 abort입니다.", "-6은 비정상 종료(abort)입니다."),
        ("ko", "커뮤니케이터를 중단한 뒤 종료하므로", "커뮤니케이터를 강제로 닫고(abort) 종료하므로"),
        ("ko", "누가 누구인지 합의하고", "각자의 번호를 합의해 정한 뒤"),
        ("ko", "랭크 4개에 걸쳐 평균하면", "랭크 4개에서 얻은 이 값을 평균하면"),
        ("ko", "또 한 번의 all-to-all로 출력을 되돌려 받습니다", "한 번 더 실행해 출력을 돌려받습니다"),
        ("pt-BR", "a norma é medida sobre todos os shards", "a norma é medida em todos os shards"),
        (
            "pt-BR",
            "o `prepare` divide o loader do seu próprio jeito",
            "o `prepare` faz a divisão do loader de um jeito próprio",
        ),
        ("pt-BR", "Não importa qual curva fica mais alta", "O foco não é saber qual curva fica mais alta"),
        ("ru", "прямая фаза длится m + p − 1 единиц", "фаза прямых проходов длится m + p − 1 единиц"),
        ("ru", "каждый процесс DDP владеет моделью", "у каждого процесса DDP своя модель"),
        ("ru", "потери на мелких матричных произведениях", "низкая эффективность мелких матричных произведений"),
        ("ru", "HSDP пересылает между строками только all-reduce", "HSDP выполняет между строками только all-reduce"),
        ("zh-CN", "把文件从节点上拷走", "把这些文件从节点上复制出来"),
        ("zh-CN", "TP 的流量只占计算时间的一小部分", "TP 流量所需的时间只相当于计算时间的一小部分"),
        ("zh-CN", "需要让节点中途加入时，运行代理时请设置", "需要让节点中途加入时，请为代理设置"),
        ("zh-TW", "每個 stream 各自的記憶體池", "每個串流各自的記憶體池"),
        ("zh-TW", "我們以三種配置訓練", "我們用三種設定訓練"),
        ("ko", "루트 자신의 파라미터", "루트 모듈에 직접 속한 파라미터"),
        ("ko", "위의 홀드아웃 손실이 말해 줍니다", "위의 홀드아웃 손실에서 알 수 있습니다"),
        ("ko", "나머지 랭크는 배리어로 붙잡아 둡니다", "나머지 랭크는 barrier로 붙잡아 둡니다"),
        ("ko", "커널의 OOM killer가", "커널의 OOM 킬러가"),
        ("pt-BR", "a época a passar para o `set_epoch`", "a época que deve ser passada ao `set_epoch`"),
        (
            "pt-BR",
            "uma métrica calculada como média sobre um sampler",
            "uma métrica calculada como média com um sampler",
        ),
        (
            "pt-BR",
            "inclusive o último: aí nada passa por all-reduce",
            "inclusive o último; nesse caso, nenhum all-reduce acontece",
        ),
        ("pt-BR", "o gradiente do bias", "o gradiente do viés"),
        ("pt-BR", "um hostname que resolve para um endereço", "um hostname resolvido para um endereço"),
        ("pt-BR", "(network namespaces, veth)", "(namespaces de rede, veth)"),
        ("pt-BR", "as camadas vêm da saída de volta até a entrada", "as camadas vêm na ordem da saída para a entrada"),
        ("ru", "проекции query, key и value", "проекции запросов, ключей и значений"),
        (
            "ru",
            "функция выбора, как и отчёт, приходит к 16 стадиям",
            "функция выбора, как и авторы отчёта, приходит к 16 стадиям",
        ),
        ("zh-CN", "像第 1 部分那样", "像本章第一部分那样"),
        ("zh-CN", "fp16 加梯度缩放器", "fp16 加损失缩放器"),
        ("zh-CN", "不中断的那次运行同时训练", "不间断的运行照常训练"),
        ("zh-TW", "填充的意思是：每個 epoch", "由於有填充，每個 epoch"),
        ("zh-TW", "它用一個以 `seed` 為種子的產生器", "它以 `seed` 作為產生器的種子"),
        ("ko", "순전파*와* 역전파를 트레이스하지만", "순전파와 역전파를 *모두* 트레이스하지만"),
        ("ko", "A 자신의 워커가 먼저 실패했다면", "A의 워커가 먼저 실패했다면"),
        ("ko", "PyTorch의 docstring 말대로", "PyTorch docstring에 적힌 대로"),
        ("ko", "모든 노드가 합의하는 것은", "모든 노드가 똑같이 아는 값은"),
        ("pt-BR", "um passo ainda treina", "cada passo continua treinando"),
        ("pt-BR", "até o passo 40. Antes, cada rank informa", "até o passo 40. Primeiro, cada rank informa"),
        ("ru", "## 11. Повседневный цикл обучения", "## 11. Обычный цикл обучения"),
        ("ru", "обычный выбор — `DDP(model, static_graph=True)`", "обычно выбирают `DDP(model, static_graph=True)`"),
        ("ru", "чекпоинт — это больше, чем веса", "чекпоинт — это не только веса"),
        ("ru", "сообщение должно говорить, какой файл", "из сообщения должно быть ясно, какой файл"),
        ("zh-CN", "当最后一个训练器推送之后，服务器求平均", "最后一个训练器推送完毕后，服务器求平均"),
        ("zh-CN", "每个微批次的分量都一样", "每个微批次所占的比重相同"),
        ("zh-TW", "呼叫反向傳播與最佳化器", "執行反向傳播並呼叫最佳化器"),
        ("zh-TW", "模型包裝於 {wrapper}", "模型由 {wrapper} 包裝"),
        (
            "ko",
            "조용히 지나가는 이유는 노름도 올바른 값이기 때문입니다",
            "노름도 올바른 값이므로 이 버그는 아무 경고 없이 지나갑니다",
        ),
        ("ko", "*m*을 제한하는 것은 활성화 메모리이며", "활성화 메모리가 *m*을 제한하며"),
        ("pt-BR", "os workers repetem uns aos outros", "os workers sorteiam o mesmo ruído"),
        ("pt-BR", "Aqui está o script inteiro", "Este é o script inteiro"),
        ("pt-BR", "o mesmo script roda em todo lugar", "o mesmo script roda em todos os nós"),
        ("ru", "процесс может вместо этого аварийно завершиться", "процесс может и аварийно завершиться"),
        ("ru", "над тензором, чей размер зависит от данных", "над тензором, размер которого зависит от данных"),
        ("ru", "all-reduce из одного элемента", "all-reduce одного элемента"),
        ("ru", "При оборачивании модели в DDP", "При обёртывании модели в DDP"),
        ("ru", "что произойдёт тогда, не определено", "поведение в этом случае не определено"),
        ("zh-CN", "并在每个参数所在之处更新它", "并在每个参数所在的进程上更新该参数"),
        ("zh-CN", "重新分片到这么多个 rank 上", "重新分片到 n 个 rank 上"),
        ("zh-TW", "就像 OOM killer 所做的那樣", "OOM killer 用的正是這個訊號"),
        ("ko", "메모리 부족 오류가 날지는", "메모리 부족 오류가 발생할지는"),
        ("ko", "실무의 파이프라인은", "실제 파이프라인은"),
        ("ko", "이 데모들(2절과 3절)이", "이 데모(2절과 3절)가"),
        ("ko", "계산합니다. 그러니 DDP에서는", "계산합니다. 따라서 DDP에서는"),
        ("ko", "dtype과 합의 길이에 달려 있습니다", "dtype과 더하는 항의 개수에 달려 있습니다"),
        ("ko", "랭크 간 합의 그래디언트", "랭크 간에 더한 그래디언트"),
        ("ko", "n항 합의 반올림 오차", "항 n개를 더할 때의 반올림 오차"),
        ("pt-BR", "versões mais novas do Slurm", "versões mais recentes do Slurm"),
        ("pt-BR", "por parte do capítulo, relatados no final", "por parte do capítulo, mostrados no final"),
        ("pt-BR", "as versões posteriores avisam isso no log", "as versões posteriores registram um aviso no log"),
        ("pt-BR", "cronometra a cópia de forma justa", "cronometra a cópia em condições iguais"),
        ("zh-CN", "每步 15 360 个序列", "每步 15,360 个序列"),
        ("zh-TW", "16 384 張 H100", "16,384 張 H100"),
        ("zh-TW", "在第 90 000 步耗盡記憶體", "在第 90,000 步耗盡記憶體"),
        ("ko", "H100 16 384개", "H100 16,384개"),
        ("ko", "랭크마다 다르게 시드하세요", "랭크마다 시드를 다르게 지정하세요"),
        ("ko", "같은 값으로 시드한 생성기", "같은 시드를 지정한 생성기"),
    ],
)
def test_terms_catch_the_reviewers_splits(lang, bad, good):
    assert term_findings(lang, bad), bad
    assert term_findings(lang, good) == [], good


def test_digit_grouping_rule_reads_numbers_not_names():
    # A model's size or a dtype next to a number is not a number grouped with a space.
    assert term_findings("zh-CN", "Llama 3 405B 训练时") == []
    assert term_findings("zh-TW", "Llama 3.1 70B 稠密模型") == []
    assert term_findings("ko", "bf16 989 TFLOP/s, TF32 495 TFLOP/s") == []


def test_terms_respect_where_an_entry_applies():
    # ru: «раскладка» is the parallel layout's wrong name in chapters 10-12, the right one for DCP in 05.
    assert term_findings("ru", "каждая раскладка обучает", path="chapters/ru/12-capstone-at-scale.ipynb")
    assert (
        term_findings("ru", "каждый читатель запрашивает свою раскладку", path="chapters/ru/05-checkpoints.ipynb") == []
    )
    # zh-TW: the informal 砍掉 may stay in the instructor's speaker notes.
    assert term_findings("zh-TW", "上一次在砍掉作業之前，等了多久？", kind="prose")
    assert term_findings("zh-TW", "上一次在砍掉作業之前，等了多久？", kind="notes") == []
    # ru: the code-comment conventions apply to comments only.
    assert term_findings("ru", "Ваш код: верните эпоху", kind="comments")
    assert term_findings("ru", "Ваш код здесь: верните эпоху", kind="comments") == []
    # ru: "bitwise" and rounding are one form in code comments too.
    assert term_findings("ru", "# Побитово: те же ядра", kind="comments")
    assert term_findings("ru", "# Бит в бит: те же ядра", kind="comments") == []


def test_terms_pending_entries_hide_only_that_finding(monkeypatch):
    path = "chapters/ko/99-test.ipynb"
    text = "각 랭크가 자기 샤드를 쓰고 자기 디바이스로 불러옵니다"
    assert len(term_findings("ko", text, path=path)) == 2
    monkeypatch.setattr(lint, "pending_terms", lambda: frozenset({f"{path}:cell 2: 자기"}))
    assert term_findings("ko", text, path=path) == []  # the same text in the same cell: one pending line
    assert term_findings("ko", text, path="chapters/ko/98-other.ipynb")


def test_every_term_entry_is_complete_and_passes_its_own_preferred_form():
    config = lint.config()
    assert set(config["terms"]) == set(lint.translated_languages())
    for lang, entries in config["terms"].items():
        for entry in entries:
            assert entry.get("preferred") and entry.get("why"), (lang, entry)
            assert set(entry.get("in", [])) <= {"prose", "notes", "comments", "catalog"}, entry
        for term in lint.terms(lang):
            assert not term.forbidden.search(term.preferred), (lang, term.forbidden.pattern, term.preferred)


def test_terms_read_markdown_comments_and_catalogs(tmp_path):
    chapter = tmp_path / "chapters" / "pt-BR" / "10-x.ipynb"
    chapter.parent.mkdir(parents=True)
    nb = notebook(
        markdown_cell("# Título"),
        code_cell("import os"),
        markdown_cell("FSDP2 entre nós. O código `entre nós` não conta."),
        code_cell("x = 1  # replicação entre nós"),
        lang="pt-BR",
    )
    chapter.write_text(json.dumps(nb), encoding="utf-8")
    catalog = tmp_path / "pt-BR.yml"
    catalog.write_text('# chapter 10\nbetween nodes: "entre nós"\nwithin a node: "dentro do nó"\n', encoding="utf-8")
    findings = lint.lint_paths([chapter, catalog], {"terms"})
    assert sorted((Path(f.path).name, f.where) for f in findings) == [
        ("10-x.ipynb", "cell 2"),
        ("10-x.ipynb", "cell 3"),
        ("pt-BR.yml", "line 2"),
    ]


# ---------------------------------------------------------------- rule: typography


@pytest.mark.parametrize(
    "lang, bad, good",
    [
        ("ru", "Шаг занимает 3 мс.", f"Шаг занимает 3{NBSP}мс."),
        ("ru", "Модель из 130 000 параметров.", "Модель из 130\u202f000 параметров."),
        ("ru", "Первый шаг длится 1,5 с, второй быстрее.", f"Первый шаг длится 1,5{NBSP}с, второй быстрее."),
        ("ru", "PCIe 5.0: 32 ГТ/с на линию.", f"PCIe 5.0: 32{NBSP}ГТ/с на линию."),
        ("ru", 'TP с SP вдоль "tp".', "TP с SP вдоль «tp»."),
        ("zh-CN", "在 rank 0 上运行, 然后广播。", "在 rank 0 上运行，然后广播。"),
        ("zh-CN", "计算时间 (ms) 见下表。", "计算时间（ms）见下表。"),
        ("zh-CN", "每个 rank 都得到\n完整的结果。", "每个 rank 都得到完整的结果。"),
        ("zh-TW", "誤差在 10 % 以內。", "誤差在 10% 以內。"),
        ("ko", "- **`monitored_barrier`**는 이름을 알려 줍니다.", "- **`monitored_barrier`는** 이름을 알려 줍니다."),
        ("ko", "마지막 10 %는 평가에 씁니다.", "마지막 10%는 평가에 씁니다."),
        ("pt-BR", "O primeiro passo leva 1.5 s.", "O primeiro passo leva 1,5 s."),
        ("pt-BR", "estoura em 65504 e sofre underflow", "estoura em 65.504 e sofre underflow"),
        ("pt-BR", "cerca de 0.5 do tempo", "cerca de 0,5 do tempo"),
        ("ko", "CUDA 이벤트\n(`cuda.Event`)는 멈춥니다.", "CUDA\n이벤트(`cuda.Event`)는 멈춥니다."),
        ("ko", "워커\n(worker) 4개", "워커(worker) 4개"),
        ("ru", "TP + FSDP — две оси.", f"TP + FSDP{NBSP}— две оси."),
        ("zh-TW", "- **容量。** 在一組", "- **容量**。在一組"),
        ("zh-TW", "2. **多久儲存一次？** 對第 2 節", "2. **多久儲存一次**？對第 2 節"),
        ("zh-TW", "**陷阱**。 CUDA 呼叫是非同步的。", "**陷阱**。CUDA 呼叫是非同步的。"),
        ("ru", "смещения —\x02это масштаб", "смещения — это масштаб"),
        ("zh-TW", "**非同步儲存。** 先複製", "**梯度裁剪**會做 all-reduce，只差捨入。**梯度累積**也一樣。"),
    ],
)
def test_typography_catches_each_languages_conventions(lang, bad, good):
    nb = notebook(markdown_cell(bad), markdown_cell(good), lang=lang)
    findings = lint.lint_notebook(Path("x.ipynb"), nb, {"typography"})
    assert [f.where for f in findings] and {f.where for f in findings} == {"cell 0"}, (bad, findings)


@pytest.mark.parametrize(
    "lang, good",
    [
        ("ru", "ранг 1 с рангом 0 обмениваются"),  # the preposition «с», not seconds
        ("ru", 'код `print("x")` и формула $a = "b"$'),  # quotes in code and math
        ("ru", 'ссылка [на сайт](https://example.org/a"b) в тексте'),  # a link target is not prose
        ("zh-CN", "形状为 (h, 4h) 的权重与 (批大小 × 序列长度 × 隐藏维度) 的激活"),  # tuples and math
        ("zh-CN", "每个 rank 都得到结果。\n\n下一段从这里开始。"),  # two paragraphs
        ("zh-CN", "列表：\n\n- 第一项\n- 第二项"),  # list items
        ("pt-BR", "desde o PyTorch 2.6, e no Python 3.13"),  # versions
        ("pt-BR", "um modelo de 130.000 parâmetros (Dean et al., 2012), porta 29500"),  # grouped, year, port
        ("pt-BR", "camadas de 1024 × 1024 e `0.5` em código"),  # a dimension, code
        ("ko", "**분산 autograd**는 RPC를 넘나들며"),  # the particle after plain bold text closes fine
        ("ko", "Megatron-LM은\n(가장 빠르게 바뀌는 축부터) `tp-cp` 순서로 둡니다."),  # an aside may start a line
        ("ko", "밀집 가중치는 dp에 걸쳐, 전문가는\n(edp, tp)에 걸쳐 샤딩합니다."),  # a tuple, not a gloss
        ("ko", "interleaved에서\n(p − 1)/(v m + p − 1)이며"),  # math
        ("ko", "CUDA 이벤트 (`torch.cuda.Event`)는"),  # a space on the same line is the author's choice
    ],
)
def test_typography_passes_what_is_not_prose_or_is_right(lang, good):
    assert typography(lang, good) == [], good


def test_typography_in_comments_and_catalogs():
    assert typography("pt-BR", "0.4 ms por amostra no forward", kind="comments")
    assert typography("pt-BR", "0,4 ms por amostra; a 2.13 e posteriores", kind="comments") == []
    assert typography("zh-CN", "暴露的通信 (ms)", kind="catalog")
    assert typography("zh-CN", "未被掩盖的通信（ms）", kind="catalog") == []


def test_unclosed_emphasis_is_found_by_rendering():
    assert lint.unclosed_emphasis("torchrun 아래에서 **`@record`**는 트레이스백을 씁니다.")
    assert lint.unclosed_emphasis("**修复方法：**在 `worker_init_fn` 中")  # full-width colon before the closing **
    assert lint.unclosed_emphasis("**修复方法**：在 `worker_init_fn` 中") == []
    assert lint.unclosed_emphasis("a `**kwargs` code span and 2 ** 3 in `math`") == []


# ---------------------------------------------------------------- rule: outputs

# What the outputs rule matches against: literals the course can print (here two small modules).
LITERALS = lint.literal_index(
    [
        'def close(grouped):\n    print(grouped or "(the ranks printed nothing)\\n")',
        'def report(n):\n    return {"weight unchanged": n, "scale": 2}',
        'print(tr("finished {n} batches").format(n=3))',
        'if "closing signal" in line:\n    print(line)',
    ]
)


@pytest.mark.parametrize(
    "line",
    [
        "(the ranks printed nothing)",  # a package string, shown as it is
        "{'weight unchanged': True, 'scale': 2.0}",  # a module's dict, printed by the chapter
        "[rank 1] finished 5 batches",  # a tr() string whose catalog entry is missing
    ],
)
def test_outputs_catch_the_courses_english(line):
    for lang in lint.translated_languages():
        assert lint.english_in_outputs([stdout(line + "\n")], lang, LITERALS) == [line], lang


@pytest.mark.parametrize(
    "output",
    [
        stdout("[ранг 1] завершено батчей: 5\n"),  # translated
        stdout("ранги ничего не напечатали (the ranks printed nothing)\n"),  # the page's script: a gloss
        stdout("RuntimeError: Connection closed by peer; the ranks printed nothing\n"),  # an error, quoted
        stdout("[W1125 10:00:00] closing signal SIGTERM to the ranks printed\n"),  # torchrun's log
        stdout("every rank finished in 0.8 s\n"),  # English, but not the course's: a quoted tool message
        stdout('[rank 0] result {"note": "the ranks printed nothing"}\n'),  # a machine-readable JSON line
        {"output_type": "stream", "name": "stderr", "text": "(the ranks printed nothing)\n"},  # not page text
        {"output_type": "display_data", "data": {"image/png": "", "text/plain": "<Figure size 640x480 with 1 Axes>"}},
    ],
)
def test_outputs_pass_translations_and_tool_messages(output):
    assert lint.english_in_outputs([output], "ru", LITERALS) == []


def test_outputs_read_markdown_results():
    table = "| rank | weight unchanged |\n|---:|---|\n| 0 | `x` |"
    outputs = [{"output_type": "display_data", "data": {"text/markdown": table, "text/plain": "<Markdown>"}}]
    assert lint.english_in_outputs(outputs, "ko", LITERALS) == ["weight unchanged"]


def test_outputs_rule_over_an_executed_notebook_and_the_nbval_hook(tmp_path, monkeypatch):
    monkeypatch.setattr(lint, "course_literals", lambda: LITERALS)
    path = tmp_path / "chapters" / "ko" / "99-test.ipynb"
    path.parent.mkdir(parents=True)
    cells = [code_cell("run()", [stdout("(the ranks printed nothing)\n")]), code_cell("run()", [stdout("랭크 0\n")])]
    path.write_text(json.dumps(notebook(*cells, lang="ko")), encoding="utf-8")
    assert [(f.where, f.rule, f.lang) for f in lint.lint_paths([path], {"outputs"})] == [("cell 0", "outputs", "ko")]

    class Item:  # what nbval gives the hook in conftest.py
        def __init__(self, path, outputs):
            self.path, self.test_outputs = path, outputs

    assert "(the ranks printed nothing)" in lint.check_nbval_item(Item(path, cells[0]["outputs"]))
    assert lint.check_nbval_item(Item(path, cells[1]["outputs"])) is None
    english_chapter = tmp_path / "chapters" / "en" / "99-test.ipynb"
    assert lint.check_nbval_item(Item(english_chapter, cells[0]["outputs"])) is None


def test_outputs_know_the_courses_own_literals():
    literals = lint.course_literals()
    assert len({literal for group in literals.values() for literal in group}) > 300
    assert all(len(literal.words) >= 2 for group in literals.values() for literal in group)


# ---------------------------------------------------------------- rule: particles


def particles(markdown: str) -> list[str]:
    nb = notebook(markdown_cell(markdown), lang="ko")
    return [f.message for f in lint.lint_notebook(Path("x.ipynb"), nb, {"particles"})]


@pytest.mark.parametrize(
    "bad, good",
    [
        ("`sampler.set_epoch(epoch)`를 호출합니다.", "`sampler.set_epoch(epoch)`을 호출합니다."),  # 에폭: a batchim
        ("`set_epoch`는 순서를 바꿉니다.", "`set_epoch`은 순서를 바꿉니다."),
        ("`DataLoader`은 워커를 띄웁니다.", "`DataLoader`는 워커를 띄웁니다."),  # 데이터로더: a vowel
        ("`all_reduce`을 부릅니다.", "`all_reduce`를 부릅니다."),
        ("`torchrun`로 실행합니다.", "`torchrun`으로 실행합니다."),  # 토치런: ㄴ
        ("`NCCL`으로 통신합니다.", "`NCCL`로 통신합니다."),  # 니클: ㄹ takes 로, not 으로
        ("모델은 `model`으로 감쌉니다.", "모델은 `model`로 감쌉니다."),
        ("`rank`이 0이면 저장합니다.", "`rank`가 0이면 저장합니다."),  # 랭크: a vowel
        (
            "`Join(..., throw_on_early_termination=True)`을 씁니다.",
            "`Join(..., throw_on_early_termination=True)`를 씁니다.",
        ),
        (
            "`DistributedDataParallel(module, process_group=<its column>)`로 감쌉니다.",
            "`DistributedDataParallel(module, process_group=<its column>)`으로 감쌉니다.",
        ),  # 컬럼: ㅁ
        ("**`Join`로** 감쌉니다.", "**`Join`으로** 감쌉니다."),  # inside bold
        ("`timeout`와 `backend`를 넘깁니다.", "`timeout`과 `backend`를 넘깁니다."),
        ("스테이지 `s`이 보관합니다.", "스테이지 `s`가 보관합니다."),  # a letter: 에스
        ("`epoch`면 됩니다.", "`epoch`이면 됩니다."),  # a copula needs its 이 after a consonant
        ("PyTorch은 이것을 제공합니다.", "PyTorch는 이것을 제공합니다."),  # plain Latin words too: 파이토치
        ("DDP을 씁니다.", "DDP를 씁니다."),  # an acronym read letter by letter
        ("스트림을 stream와 함께", "스트림을 stream과 함께"),  # the spelling rule: -m is ㅁ
        ("모든 kernel으로", "모든 kernel로"),  # -l is ㄹ
        ("스테이지 0는 기다립니다.", "스테이지 0은 기다립니다."),  # numbers in Sino-Korean: 영
        ("랭크 2이 보냅니다.", "랭크 2가 보냅니다."),  # 이
        ("`3`를 넘깁니다.", "`3`을 넘깁니다."),  # 삼
        ("`1`으로 나눕니다.", "`1`로 나눕니다."),  # 일: ㄹ
        ("`range(3)`와 비교합니다.", "`range(3)`과 비교합니다."),  # the last word of an expression: 삼
        ("`cuda:0`와 `cuda:1`에", "`cuda:0`과 `cuda:1`에"),  # 0 is 영 in the course, as in the style sheet
        ("`set_gradient_divide_factor(1.0)`로", "`set_gradient_divide_factor(1.0)`으로"),  # 일 점 영
        ("`nn.Linear(32, 10)`로 바꿉니다.", "`nn.Linear(32, 10)`으로 바꿉니다."),  # 십
        ("`all_to_all_single`를 실행합니다.", "`all_to_all_single`을 실행합니다."),  # 싱글: ㄹ
    ],
)
def test_particles_follow_how_the_word_is_read(bad, good):
    found = particles(bad)
    assert len(found) == 1, (bad, found)
    assert particles(good) == [], (good, particles(good))
    assert found[0].split(": write ")[1].split(" (read")[0] in good, found  # the message names the right form


@pytest.mark.parametrize(
    "good",
    [
        "`shape`을 맞추고 `shape`를 확인합니다.",  # read two ways (셰입, 셰이프): either is accepted
        "`emit`이 `exit`가 `submit`를",  # -it (이밋, 엑시트): no table entry, and the spelling does not tell
        "`SLURM_*`나 `fp16`으로",  # a pattern; digits glued to letters
        "1/k을 유지하고, 1/2을 보관합니다.",  # a fraction is read from its numerator: k분의 일
        "`DataLoader`이며 `DataLoader`입니다.",  # a copula may keep its 이 after a vowel
        "`DataLoader`에서 워커가",  # not a particle of a pair
        "`x` 는 띄어 쓴 조사",  # not attached: not judged (spacing is another matter)
    ],
)
def test_particles_pass_what_they_cannot_judge_or_is_right(good):
    assert particles(good) == [], particles(good)


def test_particle_readings_and_spelling_rule():
    assert lint.code_final("sampler.set_epoch(epoch)") == lint.CONSONANT
    assert lint.code_final("torch.cuda.synchronize()") == lint.VOWEL
    assert lint.code_final("NCCL") == lint.RIEUL and lint.word_final("kernel") == lint.RIEUL
    spelled = {
        "stream": "a consonant",
        "ring": "a consonant",
        "rank": "a vowel",
        "list": "a vowel",
        "step": "a consonant",
        "stack": "a consonant",
        "reduce": "a vowel",
        "pipeline": "a consonant",
        "module": "ㄹ",
        "batch": "a vowel",
        "tensor": "a vowel",
        "commit": None,
        "job": None,
    }
    assert {w: lint.spelled_final(w) for w in spelled} == spelled
    for key, reading in lint.readings().items():  # every reading in the table is Hangul
        assert reading is None or lint.re.fullmatch("[\uac00-\ud7a3 ]+", reading), (key, reading)


def test_particles_in_comments_and_catalogs(tmp_path):
    nb = notebook(markdown_cell("x"), code_cell("pass"), code_cell("# `rank`이 0이면\nx = 1"), lang="ko")
    assert [f.where for f in lint.lint_notebook(Path("x.ipynb"), nb, {"particles"})] == ["cell 2"]
    catalog = tmp_path / "ko.yml"
    catalog.write_text("# chapter 01\n'seed + epoch': '시드 + epoch로'\nok: '`epoch`으로'\n", encoding="utf-8")
    assert [f.where for f in lint.lint_paths([catalog], {"particles"})] == ["line 2"]
    other = notebook(markdown_cell("`rank`이"), lang="ru")  # Korean particles only on Korean pages
    assert lint.lint_notebook(Path("x.ipynb"), other, {"particles"}) == []


def test_particles_pending_entries_hide_only_that_finding(tmp_path, monkeypatch):
    path = tmp_path / "99-test.ipynb"
    path.write_text(json.dumps(notebook(markdown_cell("`rank`이 `epoch`로"), lang="ko")), encoding="utf-8")
    assert len(lint.check_particles(path, "ko")) == 2
    config = dict(lint.config())
    config["particles"] = {"ko": {**config["particles"]["ko"], "pending": [f"{path}: `rank`이"]}}
    monkeypatch.setattr(lint, "config", lambda: config)
    assert [f.message.split(": ")[1] for f in lint.check_particles(path, "ko")] == ["`epoch`로"]


# ---------------------------------------------------------------- the command


def test_command_filters_and_summary(tmp_path, capsys):
    path = tmp_path / "chapters" / "pt-BR" / "99-test.ipynb"
    path.parent.mkdir(parents=True)
    nb = notebook(markdown_cell("FSDP2 entre nós leva 1.5 s."), lang="pt-BR")
    path.write_text(json.dumps(nb), encoding="utf-8")

    assert lint.main([str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{path}:cell 0: ") for line in lines)
    assert lint.main(["--rule", "terms", str(path)]) == 1
    assert capsys.readouterr().out.count(": terms: ") == 1
    assert lint.main(["--lang", "ru", str(path)]) == 0
    assert lint.main(["--summary", str(path)]) == 1
    summary = capsys.readouterr().out.splitlines()
    assert summary[0].split() == ["rule", "pt-BR", "total"]
    assert summary[2].split() == ["terms", "1", "1"] and summary[3].split() == ["typography", "1", "1"]


def test_repository_is_clean():
    """What `make lint` checks: no finding of any rule in any language (every rule, every language)."""
    findings = lint.lint_repository(set(lint.RULES), {"en", *lint.translated_languages()})
    assert not findings, f"{len(findings)} finding(s), e.g.:\n" + "\n".join(map(str, findings[:40]))


def test_english_a_catalog_keeps_on_purpose_is_not_flagged():
    literals = lint.literal_index(
        ['print(tr("world size {world}, backend {backend}").format(world=2, backend="gloo"))']
    )
    line = "world size 2, backend gloo, estágio 1 do ZeRO"
    assert lint.english_literal(line, "pt-BR", literals) is None  # pt-BR's catalog writes "world size"
    assert lint.english_literal(line, "ru", literals) is not None  # ru's writes «размер мира»


# ---------------------------------------------------------------- rule: comments


def test_comments_catch_an_english_sentence_left_in_a_translation():
    # Both notebooks share the first three comments (a sentence, code, a quoted message); the last differs.
    kept = (
        "y = 2   # the same sums, split the same way\n"
        "# torch.load(weights_only=True)\n"
        '# "... was killed by signal SIGABRT"\n'
    )

    def chapter(last_comment: str, lang: str) -> dict:
        cell = {**code_cell(kept + f"z = 3   # {last_comment}\n"), "id": "c0ffee00"}
        return notebook(markdown_cell("# T"), {**code_cell("x = 1"), "id": "c0ffee01"}, cell, lang=lang)

    english = chapter("one thread per rank: what torchrun gives each worker", "en")
    translated = chapter("по одному потоку на ранг, как у torchrun", "ru")
    found = lint.check_comments(Path("chapters/ru/99-test.ipynb"), translated, "ru", english=english)
    assert [f.message for f in found] == ["comment left in English: 'the same sums, split the same way'"]
    assert not lint.english_comment("python -m torch.distributed.launch --nproc_per_node=4 train.py")
